"""The web UI at /ui: runs, a run's curves (live from the step event stream), a group side by side, a trajectory
with its tool calls and logprob-coloured tokens, and a trajectory search. Server-rendered HTML (Jinja2, autoescaped)
plus one small script drawing the SVG charts; no build step, nothing fetched from elsewhere at run time.

Admin auth: the admin key in a header, or the HttpOnly session cookie the login form sets, never in the URL. The
cookie is a random session id kept in the database (gateway/store/ui_sessions.py): it lasts TRAJGATE_UI_SESSION_S,
ends at logout or when the admin key changes, on every gateway sharing the database, and is `Secure` when the login
came over https (directly, or by X-Forwarded-Proto from a proxy in TRAJGATE_FORWARDED_ALLOW_IPS). Pages without it
redirect to the login form; assets and the event stream answer 401. With no admin key configured the UI is open and
says so on every page.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape

from gateway.api import runs_api
from gateway.http.auth import presented_key
from gateway.http.deps import gateway_state
from gateway.http.errors import GatewayError
from gateway.proxy.attribution import check_id
from gateway.store.ui_reads import (
    BadCursor,
    TrajectoryFilter,
    group_page,
    run_page,
    runs_overview,
    search_trajectories,
    trajectory_page,
)
from gateway.store.ui_sessions import create_session, revoke_session, session_valid
from gateway.ui.token_text import token_texts
from gateway.ui.tree_view import layout as tree_layout

UI_DIR = Path(__file__).resolve().parent
COOKIE = "trajgate_ui"
PAGE_SIZE = 50
MAX_LOGIN_BODY = 4096
# The charts on a run page: (step metric, label).
STEP_CHARTS = [
    ("loss", "loss"),
    ("ratio_mean", "IS ratio mean"),
    ("ratio_max", "IS ratio max"),
    ("clip_frac", "clip fraction"),
    ("token_accuracy", "token accuracy (sft)"),
    ("reverse_kl", "reverse KL per token (distill)"),
    ("teacher_agreement", "teacher agreement (distill)"),
    ("grad_norm", "grad norm"),
    ("tokens_per_s", "tokens/s"),
    ("merge_ratio", "merge ratio"),
    ("groups_used", "groups used"),
    ("groups_dropped", "groups dropped"),
]
# The steps table's objective columns (metric, header, decimals), between the loss and the grad norm: the policy
# objectives' ratio and clip, SFT's token accuracy, distillation's reverse KL and teacher agreement (after its ratio).
STEP_COLUMNS = [
    ("ratio_mean", "ratio mean", 3),
    ("ratio_max", "ratio max", 3),
    ("clip_frac", "clip", 3),
    ("token_accuracy", "token accuracy", 3),
    ("reverse_kl", "reverse KL", 4),
    ("teacher_agreement", "teacher agrees", 3),
]
# Before a run's first step: the columns its objective will fill.
_OBJECTIVE_COLUMNS = {
    "sft": {"token_accuracy"},
    "distill": {"ratio_mean", "ratio_max", "clip_frac", "reverse_kl", "teacher_agreement"},
}


def step_columns(loss: str, steps: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """The objective columns of a run's steps table: those its steps have metrics for (a run warm-started by
    ``--sft-data`` has token accuracy on those steps and ratios on the rest), else its objective's."""
    present = {key for key, _, _ in STEP_COLUMNS if any(key in s["metrics"] for s in steps)}
    wanted = present or _OBJECTIVE_COLUMNS.get(loss, {"ratio_mean", "ratio_max", "clip_frac"})
    return [c for c in STEP_COLUMNS if c[0] in wanted]


# Everything the UI serves: its own script and style only, no inline script, no framing.
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}

router = APIRouter(prefix="/ui", include_in_schema=False)


def _fmt(value: Any, digits: int = 3) -> str:
    """A number as a reader wants it: fixed decimals for floats, '–' for missing or not finite."""
    if value is None or isinstance(value, bool):
        return "–" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else "–"
    return str(value)


SPARK_W, SPARK_H = 80, 18  # the runs page's reward sparkline, in pixels


def _trend(points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A run's reward trend (the runs list's `reward_trend`) as the runs page draws it: an inline SVG polyline's
    points (no script, so the strict CSP allows it), the newest reward, and its change against the mean of the steps
    before it in the window. None with no finite reward to show."""
    rewards = [p["reward_mean"] for p in points if isinstance(p.get("reward_mean"), (int, float))]
    rewards = [float(r) for r in rewards if math.isfinite(r)]
    if not rewards:
        return None
    low, high = min(rewards), max(rewards)
    span = high - low or 1.0
    step_x = SPARK_W / (len(rewards) - 1) if len(rewards) > 1 else 0.0
    coords = [(i * step_x, SPARK_H - 1 - (r - low) / span * (SPARK_H - 2)) for i, r in enumerate(rewards)]
    change = rewards[-1] - sum(rewards[:-1]) / (len(rewards) - 1) if len(rewards) > 1 else None
    arrow = "–" if change is None or abs(change) < 1e-9 else ("▲" if change > 0 else "▼")
    return {
        "points": " ".join(f"{x:.1f},{y:.1f}" for x, y in coords),
        "last": rewards[-1],
        "change": change,
        "arrow": arrow,
        "steps": len(rewards),
    }


def _logprob_class(logprob: float | None) -> str:
    """A token's colour bucket by its probability; forced tokens (vLLM's -inf, stored as such) apart."""
    if logprob is None or not math.isfinite(logprob):
        return "lp-forced"
    p = math.exp(logprob)
    for bound, name in ((0.9, "lp5"), (0.7, "lp4"), (0.5, "lp3"), (0.3, "lp2"), (0.1, "lp1")):
        if p >= bound:
            return name
    return "lp0"


def _message_parts(message: Any) -> dict[str, Any]:
    """A chat message as the page shows it: role, text, tool calls (name, arguments), and the id it answers."""
    if not isinstance(message, dict):
        return {"role": "?", "text": str(message), "tool_calls": [], "tool_call_id": None}
    content = message.get("content")
    if isinstance(content, list):
        text = "\n".join(
            part.get("text", "") if isinstance(part, dict) and part.get("type") == "text" else str(part)
            for part in content
        )
    else:
        text = "" if content is None else str(content)
    return {
        "role": str(message.get("role", "?")),
        "text": text,
        "tool_calls": _tool_calls(message.get("tool_calls")),
        "tool_call_id": message.get("tool_call_id"),
    }


def _tool_calls(calls: Any) -> list[dict[str, str]]:
    out = []
    for call in calls or []:
        function = (call or {}).get("function") or {} if isinstance(call, dict) else {}
        out.append({"name": str(function.get("name", "?")), "arguments": str(function.get("arguments", ""))})
    return out


def _url(path: str, **params: Any) -> str:
    """A UI link with its query string; None-valued parameters are left out."""
    query = urlencode({k: v for k, v in params.items() if v is not None and v != ""})
    return f"/ui{path}" + (f"?{query}" if query else "")


_env = Environment(loader=FileSystemLoader(UI_DIR / "templates"), autoescape=select_autoescape(["html"]))
_env.filters["fmt"] = _fmt
_env.filters["lpclass"] = _logprob_class
_env.filters["trend"] = _trend
_env.globals["spark"] = {"width": SPARK_W, "height": SPARK_H}
_env.globals["url"] = _url


async def _authorized(request: Request) -> bool:
    """The admin key in a header, or a live session cookie; always with auth off."""
    gw = gateway_state(request)
    if gw.auth.is_admin(presented_key(dict(request.headers))):
        return True
    cookie, fingerprint = request.cookies.get(COOKIE), gw.auth.admin_fingerprint
    return cookie is not None and fingerprint is not None and await asyncio.to_thread(
        session_valid, gw.engine, cookie, fingerprint
    )


def _over_https(request: Request) -> bool:
    """Whether the browser reached us over https: directly, or through a trusted proxy that says so."""
    if request.url.scheme == "https":
        return True
    trusted = gateway_state(request).settings.forwarded_allow_ips
    client = request.client.host if request.client else None
    proto = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    return proto == "https" and ("*" in trusted or client in trusted)


async def _deny_asset(request: Request) -> None:
    if not await _authorized(request):
        raise GatewayError(401, "missing or invalid admin key (log in at /ui/login)", "authentication_error", "invalid_api_key")


def _login_redirect(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/ui/login?next={quote(target, safe='')}", status_code=303, headers=SECURITY_HEADERS)


def _page(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    auth = gateway_state(request).auth
    html = _env.get_template(template).render(open_auth=auth.admin_open, **context)
    return HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)


def _safe_next(target: str | None) -> str:
    """Only back into the UI: an open redirect would let a link send a freshly logged-in user anywhere."""
    if target and target.startswith("/ui") and not target.startswith("//") and "\\" not in target:
        return target
    return "/ui"


@router.get("/login")
async def login_form(request: Request, next: str | None = None) -> Response:
    if gateway_state(request).auth.admin_open:
        return RedirectResponse(_safe_next(next), status_code=303, headers=SECURITY_HEADERS)
    return _page(request, "login.html", next=_safe_next(next), error=None)


@router.post("/login")
async def login(request: Request) -> Response:
    """Check the admin key from the form and set the session cookie (HttpOnly, SameSite=Strict)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_LOGIN_BODY:
            raise GatewayError(413, f"login form larger than {MAX_LOGIN_BODY} bytes", code="request_too_large")
    form = parse_qs(body.decode("utf-8", "replace"))
    key = (form.get("key") or [""])[0]
    nexts = form.get("next")
    target = _safe_next(nexts[0] if nexts else None)
    gw = gateway_state(request)
    if not gw.auth.is_admin(key):
        return _page(request, "login.html", status=401, next=target, error="That is not the admin key.")
    response = RedirectResponse(target, status_code=303, headers=SECURITY_HEADERS)
    fingerprint = gw.auth.admin_fingerprint
    if fingerprint is not None:
        lifetime_s = gw.settings.ui_session_s
        session = await asyncio.to_thread(create_session, gw.engine, fingerprint, lifetime_s)
        response.set_cookie(COOKIE, session, max_age=int(lifetime_s), httponly=True, samesite="strict", path="/ui",
                            secure=_over_https(request))  # fmt: skip
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    """End the session for good (every gateway on the database refuses its cookie from now on)."""
    cookie = request.cookies.get(COOKIE)
    if cookie is not None:
        await asyncio.to_thread(revoke_session, gateway_state(request).engine, cookie)
    response = RedirectResponse("/ui/login", status_code=303, headers=SECURITY_HEADERS)
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict", secure=_over_https(request))
    return response


@router.get("/static/{name}")
async def static(name: str, request: Request) -> Response:
    await _deny_asset(request)
    path = UI_DIR / "static" / name
    if "/" in name or name.startswith(".") or not path.is_file():
        raise GatewayError(404, f"no asset {name!r}", code="not_found")
    return FileResponse(path, headers={k: v for k, v in SECURITY_HEADERS.items() if k != "cache-control"})


@router.get("")
async def runs(request: Request) -> Response:
    if not await _authorized(request):
        return _login_redirect(request)
    overview = await asyncio.to_thread(runs_overview, gateway_state(request).engine)
    return _page(request, "runs.html", runs=overview)


@router.get("/run")
async def run(request: Request, name: str) -> Response:
    if not await _authorized(request):
        return _login_redirect(request)
    runs_api._check_run_name(name)
    view = await asyncio.to_thread(run_page, gateway_state(request).engine, name)
    if view is None:
        raise GatewayError(404, f"no run {name!r}", code="run_not_found")
    # The charts of metrics the run's steps have: an SFT run has no ratio against vLLM, a policy-gradient run no
    # token accuracy. Before its first step a run shows them all.
    charts = [c for c in STEP_CHARTS if any(c[0] in s["metrics"] for s in view["steps"])] or STEP_CHARTS
    columns = step_columns(str(view["config"].get("loss", "")), view["steps"])
    chart_data = {
        "run": name,
        "steps": [{"step": s["step"], "metrics": s["metrics"]} for s in view["steps"]],
        "eval": view["eval"],
        "charts": charts,
        "columns": [[key, digits] for key, _, digits in columns],
    }
    warm = [s for s in view["steps"] if s["metrics"].get("objective") == "sft_data"]
    warm_start = {
        "first": warm[0]["step"], "last": warm[-1]["step"], "files": sorted({str(s["metrics"].get("sft_data")) for s in warm})
    } if warm else None  # fmt: skip
    return _page(
        request, "run.html", run=view, chart_data=chart_data, charts=charts, columns=columns, warm_start=warm_start
    )


@router.get("/events")
async def events(request: Request, run: str, after: str | None = None) -> Response:
    """The run's step event stream (GET /v1/runs/{run}/events) for the run page, under the UI's cookie auth."""
    await _deny_asset(request)
    return await runs_api.get_events(run, request, after, "sse")


@router.get("/group")
async def group(request: Request, id: str) -> Response:
    if not await _authorized(request):
        return _login_redirect(request)
    check_id(id, "group id")
    view = await asyncio.to_thread(group_page, gateway_state(request).engine, id)
    if view is None:
        raise GatewayError(404, f"no group {id!r}", code="group_not_found")
    return _page(request, "group.html", group=view)


@router.get("/trajectory")
async def trajectory(request: Request, id: str) -> Response:
    """A trajectory: its call tree, then each call with the messages it added (against its tree parent's request,
    or the previous call's for a root) and its completion tokens, as text when vLLM can say it (gateway.ui.token_text)."""
    if not await _authorized(request):
        return _login_redirect(request)
    check_id(id, "trajectory id")
    gw = gateway_state(request)
    view = await asyncio.to_thread(trajectory_page, gw.engine, id)
    if view is None:
        raise GatewayError(404, f"no trajectory {id!r}", code="trajectory_not_found")
    sent: dict[tuple[int, int], Any] = {}
    previous: list[Any] = []
    for call in view["calls"]:
        messages = call["messages"] if isinstance(call["messages"], list) else None
        if messages is None:  # a completions prompt: shown whole
            call["new_messages"] = [{"role": "prompt", "text": str(call["messages"]), "tool_calls": [], "tool_call_id": None}]
            call["history_changed"] = False
            continue
        parent = call["parent"]
        base = sent.get((parent["seq"], parent["choice_index"]), previous) if parent else previous
        extends = messages[: len(base)] == base
        shown = messages[len(base):] if extends else messages
        call["new_messages"] = [_message_parts(m) for m in shown]
        call["history_changed"] = not extends
        call["completion_tool_calls"] = _tool_calls(call["tool_calls"])
        sent[(call["seq"], call["choice_index"])] = messages
        if call["choice_index"] == 0:
            previous = messages
    texts = await token_texts(gw.proxy, gw.token_texts, [(c["id"], c["completion_token_ids"]) for c in view["calls"]],
                              gw.settings.ui_token_text_timeout_s)  # fmt: skip
    for call, text in zip(view["calls"], texts.texts, strict=True):
        call["token_text"] = text
    return _page(request, "trajectory.html", t=view, tree=tree_layout(view["calls"]), token_text_error=texts.error)


def _float_param(name: str, value: str | None) -> float | None:
    if value is None or value.strip() == "":
        return None
    try:
        number = float(value)
    except ValueError:
        raise GatewayError(422, f"{name}: expected a number", code="invalid_value") from None
    if not math.isfinite(number):
        raise GatewayError(422, f"{name}: expected a finite number", code="invalid_value")
    return number


@router.get("/trajectories")
async def trajectories(
    request: Request,
    run: str | None = None,
    group: str | None = None,
    mode: str | None = None,
    reward_min: str | None = None,
    reward_max: str | None = None,
    untrainable: str | None = None,
    after: str | None = None,
    limit: int = Query(PAGE_SIZE, ge=1, le=500),
) -> Response:
    """Search: by run and/or group, mode, reward range, untrainable; newest first, keyset pages (`after`)."""
    if not await _authorized(request):
        return _login_redirect(request)
    gw = gateway_state(request)
    run, group, mode = run or None, group or None, mode or None
    if run is not None:
        runs_api._check_run_name(run)
    if group is not None:
        check_id(group, "group id")
    if mode not in (None, "train", "eval"):
        raise GatewayError(422, "mode: expected 'train' or 'eval'", code="invalid_value")
    if untrainable not in (None, "", "yes", "no"):
        raise GatewayError(422, "untrainable: expected 'yes' or 'no'", code="invalid_value")
    where = TrajectoryFilter(
        run=run,
        group_id=group,
        mode=mode,
        reward_min=_float_param("reward_min", reward_min),
        reward_max=_float_param("reward_max", reward_max),
        untrainable={"yes": True, "no": False}.get(untrainable or ""),
    )
    run_names = gw.router.runs()
    items: list[dict[str, Any]] = []
    next_cursor = None
    if run is not None or group is not None:
        try:
            items, next_cursor = await asyncio.to_thread(search_trajectories, gw.engine, where, after, limit)
        except BadCursor as exc:
            raise GatewayError(400, str(exc), code="invalid_value") from None
    params = {"run": run, "group": group, "mode": mode, "reward_min": reward_min, "reward_max": reward_max,
              "untrainable": untrainable, "limit": limit if limit != PAGE_SIZE else None}  # fmt: skip
    return _page(
        request, "trajectories.html", items=items, where=params, run_names=run_names,
        next_url=_url("/trajectories", **params, after=next_cursor) if next_cursor else None,
        first_url=_url("/trajectories", **params) if after else None,
    )  # fmt: skip
