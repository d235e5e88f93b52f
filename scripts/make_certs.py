"""`make certs`: a local CA and the mesh's TLS certificates in .run/certs (see --help)."""

from __future__ import annotations

import sys

from tokenmesh.localmesh.certs import main

if __name__ == "__main__":
    sys.exit(main())
