"""ferrum's `serve` flags that kiln takes as settings but answers in its own way, said in the
effective config and the dry run rather than obeyed in silence (issue 43):

- `--disable-greedy-argmax`: ferrum then brings every greedy row's logits to the host; kiln's
  sampler has one greedy path (kiln/engine/sampler.py), so the value stays on, with the reason.
- `--tts-slots N` on a model that does not speak: only a speech model has slots.

The flags ferrum and kiln share in meaning (the scheduler knobs, served names) need no answer.
"""

from __future__ import annotations

from kiln.i18n import english, msg
from kiln.settings.resolve import ResolvedSettings

PERSON = ("cli", "env", "file")


def answer_flags(s: ResolvedSettings) -> None:
    r = s.values.get("greedy_argmax")
    if r is not None and r.value is False:
        why = msg("startup.greedy_argmax_kept", source=r.source)
        s.override("greedy_argmax", True, english(why), source=r.source,
                   code="greedy_argmax.one_greedy_path")
        s.warnings.append(why)
    slots = s.values.get("tts_slots")
    if slots is not None and slots.source in PERSON and s.get("kind") != "speech":
        s.warnings.append(msg("startup.tts_slots_not_speech", slots=slots.value,
                              source=slots.source, kind=s.get("kind")))
