"""The live pool page: `GET /status`, HTML that polls `GET /status/data` twice a second and redraws itself, showing
each gateway, each worker by role and state, what each denoiser runs (its job id: request id, output and attempt,
never the prompt), the queues, each tenant's share of them (queued, active, in flight, its oldest wait, its totals and
what is left of its quotas: GetStatus' tenants) and this front's recent throughput.

Who sees it: with API keys configured (`--api-key`), only a caller presenting an admin key (`--admin-key`, or
GLMIMAGE_ADMIN_KEYS, the gateway's own variable) gets the data; with `--tenants`, a key of a tenant whose role is
admin (another tenant's key gets 403, an unknown one 401). The page asks for the key and sends it as a Bearer
header. The data comes from each gateway's GetStatus with the credential any call of that caller carries (the
caller's own with --gateway-auth forward, this front's with own), so the gateway's own rule decides what it shows
(internal addresses only to its admins). Without keys the page is as open as the API.
"""
from __future__ import annotations

import time
from typing import Any

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from glmimage.v1 import gateway_service_pb2
from runtime.auth import bearer_token

from .deps import GatewayDep, Metrics, Settings
from .dispatch import gateway_metadata
from .errors import error_response
from .keys import Admission, FrontKeys
from .middleware import request_id

router = APIRouter()

_ROLES = {gateway_service_pb2.WORKER_ROLE_AR: "ar", gateway_service_pb2.WORKER_ROLE_DENOISER: "denoiser"}


def _worker(w: gateway_service_pb2.WorkerStatus, index: int) -> dict[str, Any]:
    return {"index": index, "role": _ROLES.get(w.role, "unknown"),
            "state": gateway_service_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower(),
            "address": w.address, "job": w.current_job, "stuck": w.stuck, "held_elsewhere": w.held_elsewhere,
            "health": w.health, "loras": list(w.loras_loaded), "step": w.step, "total_steps": w.total_steps,
            # Its release (admin role only) and whether the gateway speaks its contract (gateway.compat).
            "version": w.build.version, "revision": w.build.proto_revision, "incompatible": w.incompatible}


def _tenant(t: gateway_service_pb2.TenantStatus) -> dict[str, Any]:
    def quota(limit: int, remaining: int) -> dict[str, int] | None:  # 0: no such quota
        return {"limit": limit, "remaining": remaining} if limit else None

    return {"name": t.name, "weight": t.weight, "queued_ar": t.pending_ar_requests,
            "queued_denoise": t.pending_denoise_outputs, "active": t.active_requests,
            "inflight_images": t.inflight_images, "max_inflight_images": t.max_inflight_images or None,
            "oldest_wait_s": t.oldest_wait_seconds, "requests_total": t.requests_total, "images_total": t.images_total,
            "requests_per_minute": quota(t.requests_per_minute, t.remaining_requests),
            "images_per_minute": quota(t.images_per_minute, t.remaining_images)}


@router.get("/status", include_in_schema=False)
async def status_page() -> HTMLResponse:
    return HTMLResponse(PAGE, headers={"Cache-Control": "no-store"})


@router.get("/status/data", include_in_schema=False)
async def status_data(request: Request, settings: Settings, gateways: GatewayDep, metrics: Metrics) -> Response:
    keys: FrontKeys = request.app.state.keys
    admission = keys.admin(bearer_token(request.scope["headers"]))
    if admission is Admission.UNKNOWN:
        return error_response(401, "the status page needs an admin key", type="authentication_error",
                              code="invalid_api_key")
    if admission is Admission.NOT_ADMIN:
        return error_response(403, "the status page needs an admin key", type="permission_error",
                              code="admin_key_required")
    # The credential the gateway sees for any call of this caller (settings.gateway_auth): it decides what it shows.
    metadata = gateway_metadata(request, settings, request_id(request))
    out = []
    for index, gateway in enumerate(gateways):
        try:
            status = await gateway.stub.GetStatus(gateway_service_pb2.GetStatusRequest(), metadata=metadata,
                                                  timeout=settings.health_timeout)
        except grpc.aio.AioRpcError as err:
            out.append({"gateway": index, "error": err.code().name})
            continue
        out.append({"gateway": index, "active_requests": status.active_requests,
                    "queues": {"ar_requests": status.pending_ar_requests, "ar_outputs": status.pending_ar_outputs,
                               "denoise_outputs": status.pending_denoise_outputs},
                    "workers": [_worker(w, i) for i, w in enumerate(status.workers)],
                    "tenants": [_tenant(t) for t in status.tenants]})
    images = metrics.registry.get_sample_value("glmimage_rest_images_total") or 0  # for the page's throughput
    return JSONResponse({"time": time.time(), "images_returned": images, "gateways": out},
                        headers={"Cache-Control": "no-store"})


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>GLM-Image pool</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.5em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f3f3f3}.available{background:#e6f6e6}.busy{background:#fff2cc}.unhealthy{background:#f8d7da}
.draining{background:#e2e3f3}#error{color:#a00}#key{display:none}.muted{color:#777}
</style></head><body>
<h1>GLM-Image pool</h1>
<p class="muted">Updated <span id="updated">never</span>; <span id="throughput">-</span> images/s returned by
this front over the last minute.</p>
<form id="key"><label>Admin key <input id="keyinput" type="password" autocomplete="off"></label>
<button>Show</button></form>
<p id="error"></p><div id="gateways"></div>
<script>
"use strict";
let key = sessionStorage.getItem("glmimage-admin-key") || "";
const samples = [];
document.getElementById("key").addEventListener("submit", (e) => {
  e.preventDefault();
  key = document.getElementById("keyinput").value;
  sessionStorage.setItem("glmimage-admin-key", key);
  poll();
});
function cell(row, text, cls) {
  const td = row.insertCell(); td.textContent = text; if (cls) td.className = cls; return td;
}
function render(data) {
  samples.push([data.time, data.images_returned]);
  while (samples.length > 1 && data.time - samples[0][0] > 60) samples.shift();
  const [t0, n0] = samples[0];
  document.getElementById("throughput").textContent =
    data.time > t0 ? ((data.images_returned - n0) / (data.time - t0)).toFixed(2) : "-";
  document.getElementById("updated").textContent = new Date(data.time * 1000).toLocaleTimeString();
  const root = document.getElementById("gateways");
  root.replaceChildren();
  for (const gw of data.gateways) {
    const h = document.createElement("h2");
    h.textContent = "Gateway " + gw.gateway;
    root.appendChild(h);
    if (gw.error) { const p = document.createElement("p"); p.textContent = "unreachable: " + gw.error;
      root.appendChild(p); continue; }
    const q = document.createElement("p");
    q.className = "queues";
    q.textContent = `active requests ${gw.active_requests}; waiting for the AR: ${gw.queues.ar_requests} ` +
      `requests (${gw.queues.ar_outputs} images); waiting for a denoiser: ${gw.queues.denoise_outputs} images`;
    root.appendChild(q);
    const table = document.createElement("table");
    table.className = "workers";
    const head = table.createTHead().insertRow();
    for (const t of ["#", "role", "address", "state", "running", "notes"]) head.appendChild(
      Object.assign(document.createElement("th"), {textContent: t}));
    const body = table.createTBody();
    for (const w of gw.workers) {
      const row = body.insertRow();
      row.className = "worker " + w.role;
      row.dataset.state = w.state;
      cell(row, w.index); cell(row, w.role); cell(row, w.address || "(hidden)");
      cell(row, w.state, w.state);
      const steps = w.total_steps ? ` (step ${w.step} of ${w.total_steps})` : "";
      cell(row, (w.job || (w.held_elsewhere ? "another gateway's job" : "")) + steps, "job");
      const health = w.health && !["ok", "serving"].includes(w.health) ? w.health : "";
      const adapters = w.loras && w.loras.length ? "adapters: " + w.loras.join(", ") : "";
      const release = w.version ? `release ${w.version} (contract ${w.revision || 1})` : "";
      cell(row, [w.stuck ? "stuck" : "", health, adapters, release].filter(Boolean).join("; "));
    }
    root.appendChild(table);
    if (gw.tenants && gw.tenants.length) root.appendChild(tenantsTable(gw.tenants));
  }
}
function quota(q) { return q ? `${q.remaining} of ${q.limit} left` : "-"; }
function tenantsTable(tenants) {
  const table = document.createElement("table");
  table.className = "tenants";
  table.createCaption().textContent = "Tenants";
  const head = table.createTHead().insertRow();
  for (const t of ["tenant", "weight", "queued AR", "queued denoise", "active", "images in flight", "oldest wait",
                   "requests", "images", "requests/min", "images/min"]) head.appendChild(
    Object.assign(document.createElement("th"), {textContent: t}));
  const body = table.createTBody();
  for (const t of tenants) {
    const row = body.insertRow();
    row.className = "tenant";
    row.dataset.name = t.name;
    cell(row, t.name, "name"); cell(row, t.weight, "weight");
    cell(row, t.queued_ar, "queued-ar"); cell(row, t.queued_denoise, "queued-denoise"); cell(row, t.active, "active");
    cell(row, t.inflight_images + (t.max_inflight_images ? " of " + t.max_inflight_images : ""), "inflight");
    cell(row, t.oldest_wait_s ? t.oldest_wait_s.toFixed(1) + " s" : "-", "wait");
    cell(row, t.requests_total, "requests"); cell(row, t.images_total, "images");
    cell(row, quota(t.requests_per_minute), "rpm"); cell(row, quota(t.images_per_minute), "ipm");
  }
  return table;
}
async function poll() {
  const headers = key ? {Authorization: "Bearer " + key} : {};
  try {
    const r = await fetch("/status/data", {headers, cache: "no-store"});
    if (r.status === 401 || r.status === 403) {
      document.getElementById("key").style.display = "block";
      document.getElementById("error").textContent = "An admin key is needed to see the pool.";
      return;
    }
    document.getElementById("error").textContent = r.ok ? "" : "status " + r.status;
    if (r.ok) render(await r.json());
  } catch (err) {
    document.getElementById("error").textContent = "the REST front is unreachable";
  }
}
poll();
setInterval(poll, 500);
</script></body></html>
"""
