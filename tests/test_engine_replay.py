"""The engine-loop replay (kvblocks.vllm.bench.engine_loop.replay) against timelines worked
out by hand: a recorded loop's CPU segments and a modelled device on one timeline."""

from __future__ import annotations

import pytest

from kvblocks.vllm.bench.engine_loop import Call, DeviceModel, Recording, replay

MS = 1e-3


def recording(calls: list[Call], arrival: float = 0.0, queue_size: int = 1) -> Recording:
    return Recording("vllm", arrival, calls, {}, queue_size)


def test_synchronous_steps_add_cpu_and_device() -> None:
    """Without a batch queue every step is schedule, device, update: 1 + 4.1 + 1 ms, the
    device idle for the 2 ms of CPU in each."""
    calls = [
        Call(before=1 * MS, tokens=100, waits=True, after=1 * MS, emitted=[("a", 1), ("b", 1)])
        for _ in range(3)
    ]
    result = replay(recording(calls), DeviceModel(4.0, per_token_us=1.0))
    step = 1 + 4.1 + 1
    assert result.tokens_per_s == pytest.approx(6 / (3 * step * MS))
    assert result.device_idle == pytest.approx(1 - 4.1 / step)
    assert result.ttft_p50 == pytest.approx(step * MS)
    assert result.itl_p50 == pytest.approx(step * MS)
    assert result.cpu_per_step == pytest.approx(2 * MS)
    assert result.steps == 3


def test_a_batch_queue_hides_cpu_shorter_than_the_device() -> None:
    """vLLM's loop with a queue of two: a call schedules and submits a batch, the next
    submits another and waits for the first. With 1 ms of CPU around 10 ms device steps
    the device never waits after the first submission; with 10 ms of CPU around 1 ms steps
    the CPU is the bound."""

    def loop(cpu_ms: float, n: int) -> list[Call]:
        calls = [Call(before=cpu_ms * MS / 2, tokens=0 + 1)]  # fills the queue, returns
        calls += [
            Call(
                before=cpu_ms * MS / 2,
                tokens=1,
                waits=True,
                after=cpu_ms * MS / 2,
                emitted=[("a", 1)],
            )
            for _ in range(n - 1)
        ]
        calls.append(Call(waits=True, after=cpu_ms * MS / 2, emitted=[("a", 1)]))
        return calls

    fast_cpu = replay(recording(loop(1, 20), queue_size=2), DeviceModel(10.0, per_token_us=0))
    # 0.5 ms before the first submission, then the device back to back for 20 steps.
    assert fast_cpu.device_idle == pytest.approx(1 - 200 / (0.5 + 200 + 0.5), rel=1e-6)
    slow_cpu = replay(recording(loop(10, 20), queue_size=2), DeviceModel(1.0, per_token_us=0))
    assert slow_cpu.device_idle > 0.85
    assert slow_cpu.tokens_per_s == pytest.approx(20 / (20 * 10 * MS), rel=0.05)


def test_an_empty_batch_takes_no_device_time() -> None:
    calls = [Call(before=1 * MS, tokens=0, waits=True, after=0.0)]
    result = replay(recording(calls), DeviceModel(5.0))
    assert result.device_idle == pytest.approx(1.0)
    assert result.steps == 0
