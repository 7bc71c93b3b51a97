"""The framework's floor: a bare FastAPI app on uvicorn over TLS that echoes the review.

It parses the AdmissionReview and answers it allowed, uid echoed, no patch:
the least any FastAPI admission webhook does. The admission benchmark runs it
with the same certificates and the same payload as `jitckpt webhook serve`.

    python -m bench.echo_server --cert-dir DIR --port 9443
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

# At module level: FastAPI resolves the handler's (string) annotations in these globals.
from fastapi import FastAPI, Request


def build_app() -> FastAPI:
    app = FastAPI()

    @app.post("/mutate")
    async def mutate(request: Request) -> dict[str, Any]:
        review = await request.json()
        uid = review.get("request", {}).get("uid", "")
        return {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {"uid": uid, "allowed": True},
        }

    return app


def main() -> int:
    import uvicorn

    arguments = argparse.ArgumentParser(description=__doc__)
    arguments.add_argument("--cert-dir", type=Path, required=True)
    arguments.add_argument("--host", default="127.0.0.1")
    arguments.add_argument("--port", type=int, default=9443)
    args = arguments.parse_args()
    uvicorn.run(
        build_app(),
        host=args.host,
        port=args.port,
        ssl_certfile=str(args.cert_dir / "tls.crt"),
        ssl_keyfile=str(args.cert_dir / "tls.key"),
        log_level="warning",
        access_log=False,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
