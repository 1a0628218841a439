/**
 * Sequence admission (daemon/engine/admission.ts): a request beyond the free slots waits while its
 * expected wait is within the budget, and is refused with a retry estimate only past it; requests
 * refused together (daemon/engine/slots.ts) are told turns behind one another.
 */
import { describe, expect, it } from 'vitest'
import { decideAdmission, expectedSlotWaitMs, ownWaitBudget } from '../../daemon/engine/index.ts'
import { PROMISE_HORIZON_MS } from '../../daemon/batcher/index.ts'
import { slotRefusalHint } from '../../daemon/engine/admission.ts'
import { createSlots } from '../../daemon/engine/slots.ts'

const policy = { budgetMs: 1000, maxWaiting: 64 }

describe('sequence admission', () => {
  it('runs at once while a slot is free and nobody waits', () => {
    expect(decideAdmission({ slots: 8, running: [48, 48], waiting: [], stepMs: 3 }, policy)).toEqual({ kind: 'run' })
  })

  it('the issue-13 burst: 16 requests of 48 tokens on 8 slots all queue (expected wait ≈ 48 steps)', () => {
    const running = Array.from({ length: 8 }, () => 48)
    const waiting: number[] = []
    for (let i = 0; i < 8; i++) {
      const d = decideAdmission({ slots: 8, running, waiting, stepMs: 3.5 }, policy)
      expect(d).toEqual({ kind: 'wait', expectedWaitMs: 48 * 3.5 })
      waiting.push(48)
    }
    // A second wave behind the first waits for two generations.
    expect(expectedSlotWaitMs({ slots: 8, running, waiting, stepMs: 3.5 })).toBe(96 * 3.5)
  })

  it('the earliest finishing sequence frees the slot; waiters ahead take slots in order', () => {
    expect(expectedSlotWaitMs({ slots: 2, running: [10, 100], waiting: [], stepMs: 1 })).toBe(10)
    expect(expectedSlotWaitMs({ slots: 2, running: [10, 100], waiting: [5], stepMs: 1 })).toBe(15)
    expect(expectedSlotWaitMs({ slots: 2, running: [10, 100], waiting: [5, 200], stepMs: 1 })).toBe(100)
  })

  it('refuses past the budget with the time until the wait fits', () => {
    const d = decideAdmission({ slots: 1, running: [2000], waiting: [], stepMs: 1 }, policy)
    expect(d).toMatchObject({ kind: 'refuse', expectedWaitMs: 2000, retryAfterMs: 1000 })
    expect((d as { reason: string }).reason).toMatch(/2000 ms .* budget of 1000 ms/)
  })

  it('an unmeasured step time (0) queues, bounded by maxWaiting', () => {
    expect(decideAdmission({ slots: 1, running: [1e6], waiting: [], stepMs: 0 }, policy)).toEqual({ kind: 'wait', expectedWaitMs: 0 })
    expect(decideAdmission({ slots: 1, running: [1], waiting: [1, 1], stepMs: 0 }, { budgetMs: 1000, maxWaiting: 2 })).toMatchObject({ kind: 'refuse' })
  })

  it('a burst refused at one instant is told turns: as many at once as slots will free, the rest after them', async () => {
    let clock = 5000
    const slots = createSlots({
      slots: 2,
      budgetMs: 1000,
      maxWaiting: 64,
      stepMs: () => 1,
      now: () => clock,
      refused: (reason, retryAfterMs) => Object.assign(new Error(reason), { retryAfterMs }),
    })
    const signal = new AbortController().signal
    await slots.acquire({ left: 3000 }, signal)
    await slots.acquire({ left: 3000 }, signal)
    // Both slots busy for 3000 steps: the wait is 3 s, 2 s past the budget.
    const hints: number[] = []
    for (let i = 0; i < 4; i++) {
      const err = await slots.acquire({ left: 400 }, signal).then(() => undefined, (e: { retryAfterMs: number }) => e)
      hints.push(err!.retryAfterMs)
    }
    // The first two find a slot each when the running pair ends; the next two 400 steps later.
    expect(hints).toEqual([2000, 2000, 2400, 2400])
    // Once the clock passes the promises, a refusal counts the queue's own wait again.
    clock += 10_000
    const late = await slots.acquire({ left: 400 }, signal).then(() => undefined, (e: { retryAfterMs: number }) => e)
    expect(late!.retryAfterMs).toBe(2000)
  })

  it('the last node that could take a request waits until its deadline, never less than the budget', () => {
    expect(ownWaitBudget({ deadline: 100_000 }, 1000, 40_000)).toBeUndefined()
    expect(ownWaitBudget({ deadline: 100_000, soleServer: true }, 1000, 40_000)).toBe(60_000)
    expect(ownWaitBudget({ deadline: 40_500, soleServer: true }, 1000, 40_000)).toBe(1000)
  })

  it('a request with its own budget (the last node that could take it) waits where the service\'s budget refuses', async () => {
    const slots = createSlots({ slots: 1, budgetMs: 1000, maxWaiting: 64, stepMs: () => 1, refused: reason => new Error(reason) })
    const signal = new AbortController().signal
    const first = { left: 3000 }
    await slots.acquire(first, signal)
    await expect(slots.acquire({ left: 10 }, signal)).rejects.toThrow(/budget of 1000 ms/)
    const waiting = slots.acquire({ left: 10 }, signal, 600_000)
    expect(slots.waiting).toBe(1)
    slots.release(first)
    await waiting
    expect(slots.active).toBe(1)
  })

  it('the hint never comes earlier than the wait alone, and no later than the horizon past it', () => {
    const s = { slots: 1, running: [2000], waiting: [], stepMs: 1 }
    const d = decideAdmission(s, policy)
    if (d.kind !== 'refuse') throw new Error('expected a refusal')
    // Promises long gone count for nothing.
    expect(slotRefusalHint(s, policy, d, [{ tokens: 1e6, returnAt: 10 }], 100, 50).retryAfterMs).toBe(1000)
    // Promises still out queue ahead, up to the horizon.
    const out = slotRefusalHint(s, policy, d, [{ tokens: 1e6, returnAt: 1e9 }], 100, 50)
    expect(out.retryAfterMs).toBe(2000 + PROMISE_HORIZON_MS - 1000)
    expect(out.promise).toEqual({ tokens: 50, returnAt: 100 + out.retryAfterMs })
  })
})
