/** The step-time estimator recovers a linear cost from history; the rate meter decays with time. */
import fc from 'fast-check'
import { describe, expect, it } from 'vitest'
import { createRateMeter, createStepTimeEstimator } from '../../daemon/batcher/index.ts'

describe('step time estimator', () => {
  it('starts from the prior', () => {
    const e = createStepTimeEstimator({ fixedMs: 2, perSequenceMs: 0.5, perTokenMs: 0.1 })
    expect(e.estimate(4, 100)).toBeCloseTo(2 + 2 + 10, 6)
    expect(e.estimate(0, 0)).toBe(0)
  })

  it('learns a linear cost from mixed runs', () => {
    fc.assert(fc.property(
      fc.record({ fixed: fc.double({ min: 0.5, max: 20, noNaN: true }), perSeq: fc.double({ min: 0, max: 3, noNaN: true }), perTok: fc.double({ min: 0.01, max: 1, noNaN: true }) }),
      fc.integer(),
      ({ fixed, perSeq, perTok }, seed) => {
        // Shapes drawn independently (a seeded generator, not the shrinker): sequences and positions
        // must vary apart for their costs to be told apart.
        let x = seed >>> 0
        const next = (n: number): number => { x = (Math.imul(x, 1_664_525) + 1_013_904_223) >>> 0; return (x >>> 16) % n }
        const truth = (s: number, t: number): number => fixed + perSeq * s + perTok * t
        const e = createStepTimeEstimator({ fixedMs: 1.5, perSequenceMs: 0.4, perTokenMs: 0.1 })
        for (let i = 0; i < 80; i++) {
          const s = 1 + next(8)
          const t = next(3) === 0 ? s : s + next(257)
          e.observe(s, t, truth(s, t))
        }
        for (const [s, t] of [[1, 1], [8, 8], [4, 200]] as const) {
          expect(Math.abs(e.estimate(s, t) - truth(s, t))).toBeLessThan(0.1 * truth(s, t) + 0.5)
        }
      },
    ), { numRuns: 100 })
  })

  it('follows decode-only history for decodes and stays finite elsewhere', () => {
    const e = createStepTimeEstimator({ fixedMs: 1.5, perSequenceMs: 0.4, perTokenMs: 0.1 })
    for (let i = 0; i < 100; i++) { const b = 1 + (i % 8); e.observe(b, b, 3 + 1.5 * b) }
    expect(e.estimate(4, 4)).toBeCloseTo(9, 0)
    expect(Number.isFinite(e.estimate(1, 256))).toBe(true)
    expect(e.estimate(1, 256)).toBeGreaterThanOrEqual(0)
  })
})

describe('rate meter', () => {
  it('reads a steady rate and decays to zero when idle', () => {
    const r = createRateMeter(1_000)
    for (let t = 0; t <= 10_000; t += 10) r.add(5, t) // 500 per second
    expect(r.perSecond(10_000)).toBeGreaterThan(450)
    expect(r.perSecond(10_000)).toBeLessThan(550)
    expect(r.perSecond(30_000)).toBeLessThan(1)
  })
})
