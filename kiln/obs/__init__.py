"""Observability while serving: JSONL traces (profile, memory stages, scheduler), request dumps
for `kiln replay`, and typed diagnostic faults. Everything here is off unless a setting turns it
on; when off, the engine's only cost is a `None` check."""
