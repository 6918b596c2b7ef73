"""The reference proxy trajgate is measured against (issue 18): FastAPI + uvicorn with an aiohttp client, no recording.

It is the bar "a plain Python proxy" sets: whatever trajgate adds on top of it (attribution, token capture, the
record handed to the writer) should cost nothing a client can see. So it does the least a proxy can: forward the
request body byte for byte, answer with the upstream's status and body, and relay an SSE stream chunk by chunk as
the upstream's reads deliver it. No parsing, no validation, no recording. Same stack choices as `trajgate serve`
(uvloop, httptools) so only the work differs.

    python bench/thin_proxy.py --port 8102 --upstream http://127.0.0.1:8101

    POST /v1/chat/completions   forwarded; `text/event-stream` answers are streamed, others returned whole
    GET  /v1/models             forwarded
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

# Hop-by-hop and length headers the server recomputes; everything else from the upstream is passed on.
_DROP = {"content-length", "transfer-encoding", "connection", "keep-alive", "server", "date"}


def build_app(upstream: str) -> FastAPI:
    """The proxy for one upstream base address (`http://host:port`, without `/v1`)."""
    session: aiohttp.ClientSession | None = None

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        nonlocal session
        # One pooled keep-alive session for the process, no per-host limit: 64 concurrent calls need 64 sockets.
        session = aiohttp.ClientSession(base_url=upstream, connector=aiohttp.TCPConnector(limit=0),
                                        timeout=aiohttp.ClientTimeout(total=600))
        yield
        await session.close()

    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        assert session is not None
        body = await request.body()
        upstream_response = await session.post("/v1/chat/completions", data=body,
                                               headers={"content-type": "application/json"})
        headers = {k: v for k, v in upstream_response.headers.items() if k.lower() not in _DROP}
        if upstream_response.content_type != "text/event-stream":
            try:
                return Response(await upstream_response.read(), status_code=upstream_response.status,
                                headers=headers)
            finally:
                upstream_response.release()

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for data in upstream_response.content.iter_any():
                    yield data
            finally:
                upstream_response.release()

        return StreamingResponse(relay(), status_code=upstream_response.status, headers=headers)

    @app.get("/v1/models")
    async def models() -> Response:
        assert session is not None
        async with session.get("/v1/models") as upstream_response:
            return Response(await upstream_response.read(), status_code=upstream_response.status,
                            media_type=upstream_response.content_type)

    @app.get("/health")
    async def health() -> Response:
        return Response(b"ok")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the upstream's base address, e.g. http://127.0.0.1:8101")
    args = parser.parse_args()
    uvicorn.run(build_app(args.upstream.rstrip("/")), host="127.0.0.1", port=args.port, loop="uvloop",
                http="httptools", log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
