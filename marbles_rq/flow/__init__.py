"""Flow control: what holds, merges, drops or spaces runs before and while they execute:
concurrency limits and priorities (`limits`, `limit_specs`), rate limits per key
(`rate_limits`, `rate_specs`, `rate_store`), durable mutexes (`locks`, `lock_store`),
and the gates an enqueue passes first:
debounce, throttle, singleton (`enqueue_gates`, `gate_specs`, `debounce`, `singleton`)."""
