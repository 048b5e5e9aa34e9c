"""The executable specification of LLM-serving schedulers (standard library only).

Modules, in reading order:

* :mod:`spec.formats`  — traces and decision logs (the data every engine shares);
* :mod:`spec.config`   — the semantic knobs and the named profiles;
* :mod:`spec.rules`    — the rule ids every decision is tagged with;
* :mod:`spec.kv`       — the KV block pool, prefix caching, allocation and freeing;
* :mod:`spec.queues`   — the waiting queue orders;
* :mod:`spec.scheduler`— request state and the step function (the engine);
* :mod:`spec.invariants` — the invariant predicates checked after every step;
* :mod:`spec.io`       — loading and validating files, atomic writes.
"""
