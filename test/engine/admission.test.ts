/**
 * Sequence admission (daemon/engine/admission.ts): a request beyond the free slots waits while its
 * expected wait is within the budget, and is refused with a retry estimate only past it.
 */
import { describe, expect, it } from 'vitest'
import { decideAdmission, expectedSlotWaitMs } from '../../daemon/engine/index.ts'

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
})
