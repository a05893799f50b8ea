"""One host split into processes: HTTP fronts on every core and one engine (`workers: N`).

`router.host.supervisor` starts and watches them, `router.host.front` and `router.host.engine`
are their main modules, `router.host.client` is the core a front's `Serving` runs over,
`router.host.messages` what crosses between them. See docs/architecture-processes.md.
"""
