/**
 * planBatch as a pure function: bounds, waits, FIFO within a priority, chunking, and no starvation
 * over many simulated rounds with arrivals and a flood of decodes.
 */
import fc from 'fast-check'
import { describe, expect, it } from 'vitest'
import { planBatch } from '../../daemon/batcher/index.ts'
import type { BatchLimits, PendingStep } from '../../daemon/batcher/index.ts'

const limitsArb: fc.Arbitrary<BatchLimits> = fc.record({
  maxBatch: fc.integer({ min: 1, max: 8 }),
  extraTokens: fc.integer({ min: 0, max: 60 }),
  maxQueueDelayMs: fc.integer({ min: 0, max: 20 }),
  extraAging: fc.integer({ min: 0, max: 40 }),
}).map(r => ({ maxBatch: r.maxBatch, maxPositions: r.maxBatch + r.extraTokens, maxQueueDelayMs: r.maxQueueDelayMs, prefillAgingMs: r.maxQueueDelayMs + r.extraAging }))

const stepArb = fc.record({
  kind: fc.constantFrom('prefill' as const, 'decode' as const),
  tokens: fc.integer({ min: 1, max: 100 }),
  enqueuedAt: fc.integer({ min: 0, max: 100 }),
})

/** Queues with one step per sequence (the runtime's invariant). */
const queueArb = fc.array(stepArb, { maxLength: 30 }).map(steps => steps.map((s, i): PendingStep => ({
  id: i, seqId: `s${i}`, kind: s.kind, tokens: s.kind === 'decode' ? 1 + (s.tokens % 3) : s.tokens, enqueuedAt: s.enqueuedAt,
})))

const nowArb = fc.integer({ min: 0, max: 300 })

/** The planner's order: by enqueue time, ties by queue position. */
const before = (q: readonly PendingStep[], a: PendingStep, b: PendingStep): boolean =>
  a.enqueuedAt < b.enqueuedAt || (a.enqueuedAt === b.enqueuedAt && q.indexOf(a) < q.indexOf(b))

describe('planBatch', () => {
  it('never exceeds maxBatch or maxPositions, and takes each step at most once, in 1..tokens positions', () => {
    fc.assert(fc.property(queueArb, limitsArb, nowArb, fc.option(fc.nat(3), { nil: undefined }), (queue, limits, now, awaiting) => {
      const { run } = planBatch(queue, limits, Math.max(now, ...queue.map(s => s.enqueuedAt)), { awaiting })
      expect(run.length).toBeLessThanOrEqual(limits.maxBatch)
      expect(run.reduce((sum, c) => sum + c.tokens, 0)).toBeLessThanOrEqual(limits.maxPositions)
      expect(new Set(run.map(c => c.step.seqId)).size).toBe(run.length)
      for (const c of run) {
        expect(queue).toContain(c.step)
        expect(c.tokens).toBeGreaterThanOrEqual(1)
        expect(c.tokens).toBeLessThanOrEqual(c.step.tokens)
      }
      // Only the last step taken from each line may be cut (a decode line cut short of the aged prefill's reserve, then that prefill).
      for (const kind of ['decode', 'prefill']) {
        const line = run.filter(c => c.step.kind === kind)
        expect(line.slice(0, -1).every(c => c.tokens === c.step.tokens)).toBe(true)
      }
    }), { numRuns: 500 })
  })

  it('never cuts a step of several positions into a one-position chunk, nor leaves one position behind (maxPositions ≥ 4)', () => {
    // onnxruntime runs one-position steps through another attention kernel (different last bits);
    // steps of two or more positions give the same bits however a prompt is split.
    fc.assert(fc.property(queueArb, limitsArb.filter(l => l.maxPositions >= 4), nowArb, (queue, limits, now) => {
      const { run } = planBatch(queue, limits, Math.max(now, ...queue.map(s => s.enqueuedAt)), { awaiting: 0 })
      for (const c of run) {
        if (c.step.tokens === 1) continue
        expect(c.tokens).toBeGreaterThanOrEqual(2)
        expect(c.step.tokens - c.tokens).not.toBe(1)
      }
    }), { numRuns: 500 })
  })

  it('runs or says how long to wait; a wait never exceeds what the oldest waiter has left of maxQueueDelayMs', () => {
    fc.assert(fc.property(queueArb, limitsArb, nowArb, (queue, limits, later) => {
      const oldest = Math.min(...queue.map(s => s.enqueuedAt))
      const now = Math.max(...queue.map(s => s.enqueuedAt), 0) + later
      const plan = planBatch(queue, limits, now)
      if (queue.length === 0) { expect(plan).toEqual({ run: [] }); return }
      expect(plan.run.length > 0).toBe(plan.wait === undefined)
      if (plan.wait !== undefined) {
        expect(plan.wait).toBeGreaterThan(0)
        expect(plan.wait).toBeLessThanOrEqual(limits.maxQueueDelayMs - (now - oldest))
      }
      if (now - oldest >= limits.maxQueueDelayMs) expect(plan.run.length).toBeGreaterThan(0)
      // A run as large as the limits allow goes at once: no one else could join it.
      const sequences = new Set(queue.filter(s => s.tokens > 0).map(s => s.seqId)).size
      if (sequences >= limits.maxBatch) expect(plan.run.length).toBeGreaterThan(0)
      // Nobody expected back: waiting buys nothing.
      expect(planBatch(queue, limits, now, { awaiting: 0 }).run.length).toBeGreaterThan(0)
    }), { numRuns: 500 })
  })

  it('is FIFO within a priority, decodes before prefills, except the aged head prefill', () => {
    fc.assert(fc.property(queueArb, limitsArb, nowArb, (queue, limits, later) => {
      const now = Math.max(...queue.map(s => s.enqueuedAt), 0) + later
      const { run } = planBatch(queue, limits, now, { awaiting: 0 })
      const taken = new Map(run.map(c => [c.step, c.tokens]))
      const whole = (s: PendingStep): boolean => taken.get(s) === s.tokens
      for (const a of queue) {
        for (const b of queue) {
          // b runs and a is ahead of it in the same class ⇒ a runs whole.
          if (a !== b && a.kind === b.kind && taken.has(b) && before(queue, a, b)) expect(whole(a)).toBe(true)
        }
      }
      const prefillsIn = run.filter(c => c.step.kind === 'prefill')
      const decodesAllIn = queue.filter(s => s.kind === 'decode').every(whole)
      if (prefillsIn.length > 0 && !decodesAllIn) {
        // Only the oldest prefill may pass waiting decodes, and only once it has aged.
        const head = queue.filter(s => s.kind === 'prefill').sort((a, b) => (before(queue, a, b) ? -1 : 1))[0]!
        expect(prefillsIn.map(c => c.step)).toEqual([head])
        expect(now - head.enqueuedAt).toBeGreaterThanOrEqual(limits.prefillAgingMs)
      }
    }), { numRuns: 500 })
  })

  it('chunks a long prefill to fit maxPositions, leaving room for decodes', () => {
    const limits: BatchLimits = { maxBatch: 4, maxPositions: 16, maxQueueDelayMs: 2, prefillAgingMs: 10 }
    const long: PendingStep = { id: 1, seqId: 'long', kind: 'prefill', tokens: 100, enqueuedAt: 0 }
    expect(planBatch([long], limits, 5).run).toEqual([{ step: long, tokens: 16 }])
    const decodes = [2, 3].map((id): PendingStep => ({ id, seqId: `d${id}`, kind: 'decode', tokens: 1, enqueuedAt: 3 }))
    expect(planBatch([long, ...decodes], limits, 5).run).toEqual([
      { step: decodes[0], tokens: 1 }, { step: decodes[1], tokens: 1 }, { step: long, tokens: 14 },
    ])
  })

  it('runs a sequence\'s steps one per run, in order', () => {
    const limits: BatchLimits = { maxBatch: 4, maxPositions: 64, maxQueueDelayMs: 0, prefillAgingMs: 0 }
    const first: PendingStep = { id: 1, seqId: 'a', kind: 'prefill', tokens: 3, enqueuedAt: 1 }
    const second: PendingStep = { id: 2, seqId: 'a', kind: 'decode', tokens: 1, enqueuedAt: 2 }
    expect(planBatch([second, first], limits, 3).run).toEqual([{ step: first, tokens: 3 }])
  })

  it('lets nothing starve: over many rounds with arrivals and a flood of decodes, every step finishes within a bound', () => {
    const scenario = fc.record({
      limits: limitsArb,
      streams: fc.integer({ min: 0, max: 12 }),
      arrivals: fc.array(fc.array(fc.integer({ min: 1, max: 80 }), { maxLength: 3 }), { maxLength: 40 }),
      dts: fc.array(fc.integer({ min: 1, max: 5 }), { minLength: 1, maxLength: 10 }),
    })
    fc.assert(fc.property(scenario, ({ limits, streams, arrivals, dts }) => {
      interface Sim extends PendingStep { tokens: number, total: number, arrivedRound: number, bound: number, ran: number }
      let queue: Sim[] = []
      let t = 0
      let nextId = 0
      const finished: Sim[] = []
      const enqueue = (seqId: string, kind: 'prefill' | 'decode', tokens: number, round: number): void => {
        const ahead = queue.reduce((sum, s) => sum + s.tokens, 0)
        // Each run moves the head of its line by ≥ 1 position; at most one wait per run; aging first.
        const bound = 2 * (ahead + tokens) + limits.prefillAgingMs + 2
        queue.push({ id: nextId++, seqId, kind, tokens, total: tokens, enqueuedAt: t, arrivedRound: round, bound, ran: 0 })
      }
      for (let s = 0; s < streams; s++) enqueue(`stream${s}`, 'decode', 1, 0)
      const rounds = 400
      for (let round = 0; round < rounds; round++) {
        arrivals[round]?.forEach((n, i) => { enqueue(`p${round}.${i}`, 'prefill', n, round) })
        const plan = planBatch(queue, limits, t)
        if (queue.length === 0) { t += 1; continue }
        if (plan.run.length === 0) {
          expect(plan.wait).toBeGreaterThan(0)
          t += plan.wait!
          continue
        }
        t += dts[round % dts.length]!
        for (const { step, tokens } of plan.run) {
          expect(tokens).toBeLessThanOrEqual(step.tokens)
          step.tokens -= tokens // chunks run front to back: the remainder is what is left
          step.ran += tokens
          if (step.tokens === 0) {
            expect(round - step.arrivedRound).toBeLessThanOrEqual(step.bound)
            finished.push(step)
            queue = queue.filter(s => s !== step)
            if (step.kind === 'decode') enqueue(step.seqId, 'decode', 1, round + 1)
          }
        }
      }
      for (const s of queue) expect(rounds - s.arrivedRound).toBeLessThanOrEqual(s.bound + 1)
      for (const s of finished) expect(s.ran).toBe(s.total)
      // Every prefill that arrived early enough finished, despite the decode flood.
      const prefillsArrived = arrivals.flat().length
      const unfinished = queue.filter(s => s.kind === 'prefill')
      expect(finished.filter(s => s.kind === 'prefill').length + unfinished.length).toBe(prefillsArrived)
    }), { numRuns: 60 })
  })
})
