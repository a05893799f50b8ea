"""The GPU check kit: the wheelhouse for a GPU host without index access, the check that runs there
(`bash scripts/gpu-check.sh`), its parts and their results table, and the rehearsal of it all on a
machine without a GPU. docs/gpu.md says how to use it."""
