"""One host split into processes: HTTP fronts on every core and one engine (`workers: N`).

`router.host.supervisor` starts and watches them, `router.host.front` and `router.host.engine`
are their main modules, `router.host.client` is the serving façade a front's app talks to,
`router.host.messages` what crosses between them. See docs/architecture-processes.md.
"""
