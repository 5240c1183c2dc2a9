#!/usr/bin/env python3
"""Write the sandbox container's seccomp profile (services/sandbox/container_profile.py) to
deploy/docker/sandbox-seccomp.json, which compose and Kubernetes both use.

The file is committed; tests/unit/test_container_profile.py fails when it is out of date.
Usage: scripts/gen_seccomp_profile.py [--check]   (--check: exit 1 if the file is stale)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.sandbox import container_profile  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the committed file is current")
    args = parser.parse_args()
    path = ROOT / container_profile.PROFILE_PATH
    text = container_profile.render()
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"{container_profile.PROFILE_PATH} is stale: run scripts/gen_seccomp_profile.py",
                  file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {container_profile.PROFILE_PATH}: {len(container_profile.allowed_calls())} calls allowed, "
          f"{len(container_profile.denied_calls())} denied, the rest checked by argument or unnamed (EPERM)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
