/** refusalTurn: a refused burst is promised turns one after another (daemon/batcher/refusal.ts). */
import { describe, expect, it } from 'vitest'
import { PROMISE_HORIZON_MS, refusalTurn } from '../../daemon/batcher/refusal.ts'

describe('refusalTurn', () => {
  it('tells prompts refused together successive turns, each after the work promised before it', () => {
    let tail = 0
    const turns: number[] = []
    for (let i = 0; i < 3; i++) {
      const r = refusalTurn(tail, 1000, 1500, 400)
      turns.push(r.retryAfterMs)
      tail = r.tail
    }
    expect(turns).toEqual([1500, 1900, 2300])
    expect(tail).toBe(1000 + 2300 + 400)
  })

  it('counts the queue alone once its wait reaches past what was promised', () => {
    // Promised work ends at 2,000; at 1,500 with a 900 ms wait the queue ends later (2,400).
    expect(refusalTurn(2000, 1500, 900, 100)).toEqual({ retryAfterMs: 900, tail: 2500 })
    // Long after: nothing promised is left.
    expect(refusalTurn(2000, 10_000, 1200, 100)).toEqual({ retryAfterMs: 1200, tail: 11_300 })
  })

  it('promises no turn more than the horizon past the queue\'s own wait (a sustained flood)', () => {
    let tail = 0
    let last = 0
    for (let i = 0; i < 10_000; i++) {
      const r = refusalTurn(tail, 1000, 500, 100)
      tail = r.tail
      last = r.retryAfterMs
    }
    expect(last).toBe(500 + PROMISE_HORIZON_MS)
    expect(tail).toBe(1000 + 500 + PROMISE_HORIZON_MS + 100)
  })

  it('says at least 1 ms, and reads negative estimates as none', () => {
    expect(refusalTurn(0, 50, 0.2, -5)).toEqual({ retryAfterMs: 1, tail: 50.2 })
    expect(refusalTurn(0, 50, -3, 10)).toEqual({ retryAfterMs: 1, tail: 60 })
  })
})
