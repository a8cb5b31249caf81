"""Sleep mode in the offline API (LLM's methods, vLLM's names): sleep(level), wake_up(tags),
is_sleeping(), and update_weights(path). Each control goes to the scheduler core as the
gateway's would (wire/engine_control.py) and the engine runs until its answer comes; needs
LLM(..., enable_sleep_mode=True)."""
from __future__ import annotations

import itertools

from pagewire.wire.engine_control import (ABORT, WAIT, ControlDone, EngineControl,
                                          SleepEngine, UpdateWeights, WakeEngine)

_ids = itertools.count()


class SleepCalls:
    """Mixed into LLM: uses its _deliver, _submit_plans, _apply_oldest_step and engine."""

    def sleep(self, level: int = 1, mode: str = ABORT) -> list[str]:
        """Free the KV pool; level 1 keeps the weights in host memory, level 2 drops them.
        mode "abort" ends requests added and unfinished, "wait" runs them to their end
        first. Returns what is asleep."""
        return self._control(SleepEngine(req_id=self._control_id(), level=level, mode=mode))

    def wake_up(self, tags: list[str] | None = None) -> list[str]:
        """Bring back what `tags` names ("weights", "kv_cache"; None: both). Returns what is
        still asleep."""
        return self._control(WakeEngine(req_id=self._control_id(), tags=list(tags or [])))

    def is_sleeping(self) -> bool:
        return bool(self.engine.core.pause.asleep)

    def update_weights(self, path: str, mode: str = WAIT) -> list[str]:
        """Serve the weights at `path` (the same architecture and shapes) from now on; the
        prefix cache is cleared. Raises ValueError when the path is refused (the old weights
        keep serving)."""
        return self._control(UpdateWeights(req_id=self._control_id(), path=path, mode=mode))

    def _control_id(self) -> str:
        if not self.config.model.enable_sleep_mode:
            raise ValueError("sleep mode needs LLM(..., enable_sleep_mode=True)")
        return f"control-{next(_ids)}"

    def _control(self, msg: EngineControl) -> list[str]:
        """Run the engine until the control's answer; raise its error."""
        self._controls[msg.req_id] = None
        self._deliver([("scheduler", msg)])
        while self._controls[msg.req_id] is None:
            self._submit_plans()
            if not self.engine.num_in_flight:
                raise RuntimeError("the engine holds a control it cannot send")
            self._apply_oldest_step()
        done: ControlDone = self._controls.pop(msg.req_id)
        if done.status != 200:
            raise (ValueError if done.status == 400 else RuntimeError)(done.error)
        return done.asleep
