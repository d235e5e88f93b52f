// The live ops page: subscribes to OpsService.SubscribeDashboard over gRPC-Web (same origin,
// through Envoy's edge) and renders every snapshot; reconnects with backoff when the stream ends.
import { createClient } from "@connectrpc/connect";
import { createGrpcWebTransport } from "@connectrpc/connect-web";
import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";
import "./style.css";
import {
  CircuitState,
  type DashboardSnapshot,
  OpsService,
} from "./gen/tokenmesh/v1/ops_pb";

const INTERVAL_MS = 1000;
// Points kept on the charts: five minutes at one snapshot a second.
const HISTORY = 300;
const RETRY_MIN_MS = 500;
const RETRY_MAX_MS = 10_000;

const CIRCUIT_NAMES: Record<CircuitState, string> = {
  [CircuitState.UNSPECIFIED]: "unknown",
  [CircuitState.CLOSED]: "closed",
  [CircuitState.HALF_OPEN]: "half-open",
  [CircuitState.OPEN]: "open",
};

function byId<T extends HTMLElement = HTMLElement>(id: string): T {
  const element = document.getElementById(id);
  if (!element) throw new Error(`#${id} is missing from index.html`);
  return element as T;
}

function fixed(value: number, digits: number): string {
  return Number.isFinite(value) ? value.toFixed(digits) : "–";
}

function duration(seconds: number): string {
  if (!Number.isFinite(seconds)) return "–";
  return seconds < 1 ? `${(seconds * 1000).toFixed(0)} ms` : `${seconds.toFixed(2)} s`;
}

function share(ratio: number): string {
  return Number.isFinite(ratio) ? `${(ratio * 100).toFixed(1)} %` : "–";
}

function cell(
  row: HTMLTableRowElement,
  text: string,
  name?: string,
  value?: string,
): HTMLTableCellElement {
  const td = row.insertCell();
  td.textContent = text;
  if (name) td.dataset.name = name;
  if (value !== undefined) td.dataset.value = value;
  return td;
}

function setMetric(id: string, value: number, text: string): void {
  const output = byId(id);
  output.textContent = text;
  output.dataset.value = String(value);
}

/** A uPlot time series chart that keeps the last HISTORY points and follows its width. */
class Chart {
  private readonly data: number[][];
  private readonly plot: uPlot;

  constructor(container: HTMLElement, series: { label: string; stroke: string }[]) {
    this.data = [[], ...series.map(() => [])];
    const options: uPlot.Options = {
      width: container.clientWidth || 500,
      height: 200,
      series: [{}, ...series.map((s) => ({ ...s, width: 2, spanGaps: false }))],
      axes: [{ stroke: "#9aa4b2", grid: { stroke: "#2a3140" } }, { stroke: "#9aa4b2", grid: { stroke: "#2a3140" } }],
      scales: { y: { range: (_u, _min, max) => [0, max > 0 ? max * 1.15 : 1] } },
      legend: { live: false },
    };
    this.plot = new uPlot(options, this.data as uPlot.AlignedData, container);
    new ResizeObserver(() => {
      this.plot.setSize({ width: container.clientWidth, height: 200 });
    }).observe(container);
  }

  push(seconds: number, values: number[]): void {
    this.data[0].push(seconds);
    values.forEach((value, i) => this.data[i + 1].push(Number.isFinite(value) ? value : NaN));
    if (this.data[0].length > HISTORY) this.data.forEach((column) => column.shift());
    // uPlot draws null as a gap; NaN (no stream started in the window) means no value.
    const aligned = this.data.map((column, i) =>
      i === 0 ? column : column.map((v) => (Number.isNaN(v) ? null : v)),
    );
    this.plot.setData(aligned as uPlot.AlignedData);
  }
}

const tokensChart = new Chart(byId("tokens-chart"), [
  { label: "tokens/s (all gateways)", stroke: "#4cc38a" },
]);
const ttftChart = new Chart(byId("ttft-chart"), [
  { label: "p50", stroke: "#5aa9e6" },
  { label: "p99", stroke: "#f2a541" },
]);

function render(snapshot: DashboardSnapshot): void {
  const taken = Number(snapshot.takenUnixMillis);
  setMetric("requests-per-second", snapshot.requestsPerSecond, fixed(snapshot.requestsPerSecond, 1));
  setMetric("tokens-per-second", snapshot.tokensPerSecond, fixed(snapshot.tokensPerSecond, 1));
  setMetric("ttft-p50", snapshot.ttftP50Seconds, duration(snapshot.ttftP50Seconds));
  setMetric("ttft-p99", snapshot.ttftP99Seconds, duration(snapshot.ttftP99Seconds));
  const degraded = Number(snapshot.degradedResponsesTotal);
  setMetric("degraded", degraded, String(degraded));
  const resumed = Number(snapshot.resumptionsTotal);
  setMetric("resumed", resumed, String(resumed));

  const circuit = CIRCUIT_NAMES[snapshot.rerankerCircuit] ?? "unknown";
  byId("circuit").dataset.state = circuit;
  byId("circuit-label").textContent = circuit;
  const gateways = byId("gateway-circuits");
  gateways.replaceChildren(
    ...snapshot.gatewayCircuits.map((gateway) => {
      const item = document.createElement("li");
      item.dataset.state = CIRCUIT_NAMES[gateway.state] ?? "unknown";
      item.textContent = `${gateway.gateway}: ${item.dataset.state}`;
      return item;
    }),
  );

  const workers = byId<HTMLTableElement>("workers").tBodies[0];
  workers.replaceChildren();
  for (const worker of snapshot.workers) {
    const row = workers.insertRow();
    row.dataset.address = worker.address;
    row.dataset.serving = String(worker.serving);
    cell(row, worker.address, "address");
    // The base model its engine serves, and its pool when it is a further pool's.
    const model = cell(row, worker.model || "–", "model", worker.model);
    model.dataset.pool = worker.pool;
    if (worker.pool) model.append(` (pool ${worker.pool})`);
    cell(row, worker.serving ? "SERVING" : "NOT SERVING", "health");
    cell(row, String(worker.runningRequests), "running", String(worker.runningRequests));
    cell(row, String(worker.waitingRequests), "waiting", String(worker.waitingRequests));
    const kv = row.insertCell();
    kv.dataset.name = "kv";
    kv.dataset.value = String(worker.kvCacheUsage);
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.setProperty("--fill", `${Math.min(100, worker.kvCacheUsage * 100)}%`);
    const percent = worker.kvCacheUsage * 100;
    kv.append(bar, ` ${percent.toFixed(percent > 0 && percent < 1 ? 2 : 1)} %`);
    cell(row, fixed(worker.tokensPerSecond, 1), "tokens", String(worker.tokensPerSecond));
    // Share of prompt tokens found in the prefix cache over the feed's rate window (– without
    // lookups in it); the engine's totals on hover.
    const hits = cell(
      row,
      share(worker.prefixCacheHitRatio),
      "prefix-hits",
      String(worker.prefixCacheHitRatio),
    );
    hits.title = `${worker.prefixCacheHits} of ${worker.prefixCacheQueries} prompt tokens cached since the engine started`;
    cell(row, worker.error, "error");
  }

  // Each model's and adapter's streams, whatever their path (the workers' `model` label).
  const models = byId<HTMLTableElement>("models").tBodies[0];
  models.replaceChildren();
  for (const model of snapshot.models) {
    const row = models.insertRow();
    cell(row, model.model, "model", model.model);
    cell(row, fixed(model.tokensPerSecond, 1), "tokens", String(model.tokensPerSecond));
    cell(row, fixed(model.streamsPerSecond, 2), "streams", String(model.streamsPerSecond));
    cell(
      row,
      fixed(model.failedStreamsPerSecond, 2),
      "failed",
      String(model.failedStreamsPerSecond),
    );
    cell(row, duration(model.ttftP50Seconds), "ttft-p50", String(model.ttftP50Seconds));
    cell(row, duration(model.ttftP99Seconds), "ttft-p99", String(model.ttftP99Seconds));
  }
  byId("no-models").hidden = snapshot.models.length > 0;

  const errors = byId<HTMLTableElement>("errors").tBodies[0];
  errors.replaceChildren();
  for (const error of snapshot.recentErrors) {
    const row = errors.insertRow();
    cell(row, error.service);
    cell(row, error.method);
    cell(row, error.code, "code");
    cell(row, String(error.count), "count");
  }
  byId("no-errors").hidden = snapshot.recentErrors.length > 0;

  const warnings = byId("warnings");
  warnings.hidden = snapshot.warnings.length === 0;
  warnings.replaceChildren(
    ...snapshot.warnings.map((text) => {
      const item = document.createElement("li");
      item.textContent = text;
      return item;
    }),
  );

  tokensChart.push(taken / 1000, [snapshot.tokensPerSecond]);
  ttftChart.push(taken / 1000, [snapshot.ttftP50Seconds, snapshot.ttftP99Seconds]);
  byId("updated").textContent = `last snapshot ${new Date(taken).toLocaleTimeString()}`;
}

function setConnection(state: "connecting" | "live" | "reconnecting", detail = ""): void {
  const status = byId("connection");
  status.dataset.state = state;
  status.textContent = detail ? `${state}: ${detail}` : state;
  status.title = detail;
}

async function subscribe(): Promise<never> {
  const transport = createGrpcWebTransport({ baseUrl: window.location.origin });
  const client = createClient(OpsService, transport);
  let retry = RETRY_MIN_MS;
  for (;;) {
    try {
      setConnection("connecting");
      for await (const snapshot of client.subscribeDashboard({ intervalMs: INTERVAL_MS })) {
        setConnection("live");
        retry = RETRY_MIN_MS;
        render(snapshot);
      }
      setConnection("reconnecting", "the stream ended");
    } catch (error) {
      setConnection("reconnecting", error instanceof Error ? error.message : String(error));
    }
    await new Promise((resolve) => setTimeout(resolve, retry));
    retry = Math.min(RETRY_MAX_MS, retry * 2);
  }
}

void subscribe();
