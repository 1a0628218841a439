/** The step-time estimator recovers a linear cost from history; the rate meter decays with time. */
import fc from 'fast-check'
import { describe, expect, it } from 'vitest'
import { createDecodeTimeTable, createRateMeter, createStepTimeEstimator } from '../../daemon/batcher/index.ts'

describe('decode time table', () => {
  it('says nothing from one count but that count, and reads a count at its own average', () => {
    const t = createDecodeTimeTable()
    expect(t.estimate(1)).toBeUndefined()
    for (const ms of [2, 2, 2, 2]) t.observe(1, ms)
    expect(t.estimate(1)).toBe(2)
    expect(t.estimate(4)).toBeUndefined()
  })

  it('interpolates between measured counts and carries the line past them, never below 0 or past the nearest downwards', () => {
    const t = createDecodeTimeTable()
    for (let i = 0; i < 5; i++) { t.observe(2, 2); t.observe(4, 3); t.observe(8, 5) }
    expect(t.estimate(3)).toBeCloseTo(2.5, 9)
    expect(t.estimate(6)).toBeCloseTo(4, 9)
    expect(t.estimate(16)).toBeCloseTo(9, 9) // the line through 4 and 8
    expect(t.estimate(1)).toBeCloseTo(1.5, 9) // the line through 2 and 4
    const steep = createDecodeTimeTable()
    steep.observe(2, 1); steep.observe(3, 10)
    expect(steep.estimate(1)).toBe(0)
  })

  it('keeps a count apart from the others: a burst of eight-row runs and repacks leaves one row where it was', () => {
    // The linear model's failure this replaces (engine-notes, wave 25): one-row runs of 1.7 ms,
    // then eight-row runs of 5 ms and a few of 2–7 rows at 15–30 ms.
    const t = createDecodeTimeTable()
    for (let i = 0; i < 50; i++) t.observe(1, 1.7)
    for (let i = 0; i < 60; i++) t.observe(8, 5)
    for (const [rows, ms] of [[7, 10], [4, 24], [2, 16], [2, 3], [5, 30]] as const) t.observe(rows, ms)
    expect(t.estimate(1)).toBeCloseTo(1.7, 9)
    expect(t.estimate(8)).toBeCloseTo(5, 9)
    const e = createStepTimeEstimator({ fixedMs: 1.5, perSequenceMs: 0.4, perTokenMs: 0.1 })
    for (let i = 0; i < 50; i++) e.observe(1, 1, 1.7)
    for (let i = 0; i < 60; i++) e.observe(8, 8, 5)
    for (const [rows, ms] of [[7, 10], [4, 24], [2, 16], [2, 3], [5, 30]] as const) e.observe(rows, rows, ms)
    expect(e.estimate(1, 1)).toBeGreaterThan(5)
  })

  it('bounds a run far past its count\'s average, once it has a few', () => {
    const t = createDecodeTimeTable(0.5)
    for (let i = 0; i < 4; i++) t.observe(8, 5)
    t.observe(8, 100) // counted as 10: twice the average
    expect(t.estimate(8)).toBeCloseTo(7.5, 9)
    // Slower runs that go on are learnt, the bound growing with the average.
    for (let i = 0; i < 20; i++) t.observe(8, 40)
    expect(t.estimate(8)).toBeGreaterThan(39)
  })
})

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
