"""supervisord with every program in a session of its own: `python supervise_sessions.py -c
<config>` (sessions_ab.py starts one of its two meshes with it).

supervisord puts each program in a process group of its own (setpgrp), inside supervisord's
session. Linux schedules each session as one group (autogroups), so every program of the local
mesh shared one share of a core: Envoy, the gateway and the worker's front end, on the core
they share, competed inside one group, while a load generator or a second Envoy each had a
group of their own. The mesh's own Envoy then spent twice the CPU per token of the same Envoy
started in a session of its own (20 to 24 against 8 to 11 us at 64 streams). A session per
program is what a container per service gives on Kubernetes. supervisord has no setting for
it, so the one call of its options that makes the group is replaced. Measured, not adopted:
see ../README.md.
"""

from __future__ import annotations

import os
import sys

from supervisor import supervisord
from supervisor.options import ServerOptions
from supervisor.states import SupervisorStates


class SessionOptions(ServerOptions):
    def setpgrp(self) -> None:
        """In the forked child before it execs the program: a new session, whose process
        group (the child's pid) is what setpgrp made, so stopping and killing "as group" reach
        the same processes."""
        os.setsid()


def main(argv: list[str]) -> None:
    """supervisord's own main (supervisor.supervisord.main), with SessionOptions."""
    first = True
    while True:
        options = SessionOptions()
        options.realize(argv, doc=supervisord.__doc__)
        options.first = first
        options.test = False
        supervisord.go(options)
        options.close_httpservers()
        options.close_logger()
        first = False
        if options.mood < SupervisorStates.RESTARTING:
            break


if __name__ == "__main__":
    main(sys.argv[1:])
