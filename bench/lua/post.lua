-- wrk script: POST a chat completion (non-streaming or streaming) and print a JSON summary.
-- Environment: BENCH_BODY (the JSON body), BENCH_AUTH (bearer secret, optional).
-- Non-2xx answers count as errors.status, socket errors as connect/read/write/timeout.

wrk.method = "POST"
wrk.body = os.getenv("BENCH_BODY")
wrk.headers["Content-Type"] = "application/json"
local auth = os.getenv("BENCH_AUTH")
if auth and auth ~= "" then
  wrk.headers["Authorization"] = "Bearer " .. auth
end

-- Non-2xx answers by status, per thread, so a run with errors says which (429? 503?).
local threads = {}
function setup(thread)
  table.insert(threads, thread)
end
function init(args)
  statuses = {}
end
function response(status, headers, body)
  if status >= 300 then
    statuses[status] = (statuses[status] or 0) + 1
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests": %d, "duration_us": %d, "bytes": %d, ' ..
    '"errors": {"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}, ' ..
    '"latency_us": {"p50": %d, "p90": %d, "p99": %d, "max": %d, "mean": %.1f}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, latency.mean))
  for _, thread in ipairs(threads) do
    for status, n in pairs(thread:get("statuses")) do
      io.write(string.format('BENCH_STATUS %d %d\n', status, n))
    end
  end
end
