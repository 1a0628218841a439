/**
 * Admission under overload, against the SimulatedExecutor: prefills submitted at ~10× the rate the
 * executor sustains for a bounded time. Refusals are immediate and typed (SHOAL_ERR_OVERLOADED with
 * retryAfterMs), every admitted step completes with its own result, and afterwards the batcher
 * drains and admits again. Bounds are generous; nothing here measures speed.
 */
import { afterEach, describe, expect, it } from 'vitest'
import { createBatcher } from '../../daemon/batcher/index.ts'
import type { Batcher, StepRequest, StepResult } from '../../daemon/batcher/index.ts'
import type { OverloadedError } from '../../daemon/errors.ts'
import { httpStatusOf } from '../../daemon/errors.ts'
import { SimulatedExecutor, rowsOf, seqHash } from './simulated-executor.ts'

let batcher: Batcher | undefined
afterEach(async () => { await batcher?.stop() })

const sleep = (ms: number): Promise<void> => new Promise(resolve => setTimeout(resolve, ms))
const nextMacrotask = (): Promise<void> => new Promise(resolve => setImmediate(resolve))

describe('batcher admission under overload', () => {
  it('refuses fast with typed 429s, completes what it admitted, and recovers', async () => {
    // One full run: 4 prefills × 16 positions = 64 positions ≈ 4 + 3.2 ms ⇒ ~550 prefills/s sustained.
    const sim = new SimulatedExecutor({ fixedMs: 4, perTokenMs: 0.05 })
    const budgetMs = 40
    const b = createBatcher({ limits: { maxBatch: 4, maxPositions: 64, maxQueueDelayMs: 2 }, budgetMs }, { executor: sim })
    batcher = b
    await b.start()

    const prompt = (i: number): { positions: number[], tokenIds: number[] } => {
      const positions = Array.from({ length: 16 }, (_, p) => p)
      return { positions, tokenIds: positions.map(p => (i + p) % 1000) }
    }
    interface Sent { seqId: string, settled: boolean, settledAtSubmit: boolean, outcome: Promise<{ ok: StepResult } | { err: unknown }> }
    const sent: Sent[] = []
    // ~5,600 prefills/s (28 every 5 ms) for ~300 ms: about 10× what the executor sustains.
    const until = performance.now() + 300
    let n = 0
    while (performance.now() < until) {
      const tick: Sent[] = []
      for (let k = 0; k < 28; k++) {
        const seqId = `r${n++}`
        const { positions, tokenIds } = prompt(n)
        const s: Sent = { seqId, settled: false, settledAtSubmit: false, outcome: b.submit({ seqId, kind: 'prefill', input: { tokenIds }, positions }).then(ok => ({ ok }), (err: unknown) => ({ err })) }
        void s.outcome.then(() => { s.settled = true })
        tick.push(s)
      }
      await nextMacrotask()
      // Whatever has settled by now was decided at submit time (no run finishes within a macrotask).
      for (const s of tick) s.settledAtSubmit = s.settled
      sent.push(...tick)
      await sleep(5)
    }

    const outcomes = await Promise.all(sent.map(async s => ({ s, o: await s.outcome })))
    const refused = outcomes.filter(({ o }) => 'err' in o)
    const admitted = outcomes.filter(({ o }) => 'ok' in o)
    expect(refused.length).toBeGreaterThan(sent.length / 2)
    expect(admitted.length).toBeGreaterThan(20)
    for (const { s, o } of refused) {
      const err = (o as { err: OverloadedError }).err
      expect(err.code).toBe('SHOAL_ERR_OVERLOADED')
      expect(httpStatusOf(err).status).toBe(429)
      expect(err.retryAfterMs).toBeGreaterThan(0)
      expect(s.settledAtSubmit).toBe(true) // refused at submit, not after queueing
    }
    for (const { s, o } of admitted) {
      const r = rowsOf((o as { ok: StepResult }).ok)
      expect(r.kind).toBe('logits')
      expect(r.data[0]).toBe(seqHash(s.seqId))
      expect(r.data[1]).toBe(15)
    }

    // Recovery: the queue drains and new work is admitted and served.
    expect(b.load().queueDepth).toBe(0)
    await sleep(20)
    expect(b.load().expectedWaitMs).toBeLessThanOrEqual(budgetMs)
    // Two waves of one full run each: eight at once would queue the eighth two runs deep, and the
    // estimator's run time, learned from this loaded process's timers, can put that past the
    // budget (43 against 40 ms in one CI run) — a correct refusal, not a failure to recover.
    const after: StepResult[] = []
    for (const wave of [0, 4]) {
      after.push(...await Promise.all(Array.from({ length: 4 }, async (_, i) => {
        const { positions, tokenIds } = prompt(wave + i)
        return await b.submit({ seqId: `after${wave + i}`, kind: 'prefill', input: { tokenIds }, positions })
      })))
    }
    expect(after.map(r => rowsOf(r).data[0])).toEqual(Array.from({ length: 8 }, (_, i) => seqHash(`after${i}`)))
  })

  /**
   * One prefill of 64 positions ≈ 4 + 3.2 ms; a 10 ms budget takes the first two of a burst of ten.
   * A burst is refused at one instant (`hold` stills the clock), as a burst arriving in one turn of
   * the event loop is: a pause of the test's own process must not move its turns.
   */
  async function heldClockBatcher (): Promise<{ b: Batcher, hold: (still: boolean) => void }> {
    const sim = new SimulatedExecutor({ fixedMs: 4, perTokenMs: 0.05 })
    let held: number | undefined
    const clock = { now: (): number => held ?? performance.now() }
    const b = createBatcher({ limits: { maxBatch: 1, maxPositions: 64, maxQueueDelayMs: 0 }, budgetMs: 10 }, { executor: sim, clock })
    batcher = b
    await b.start()
    return { b, hold: still => { held = still ? performance.now() : undefined } }
  }
  const prefill = (seqId: string, budgetMs?: number): StepRequest => {
    const positions = Array.from({ length: 64 }, (_, p) => p)
    return { seqId, kind: 'prefill', input: { tokenIds: positions }, positions, ...(budgetMs === undefined ? {} : { budgetMs }) }
  }

  it('a burst refused together is told staggered turns, one prefill apart', async () => {
    const { b, hold } = await heldClockBatcher()
    // Teach the estimator this executor's step time first (its prior is another model's).
    for (let i = 0; i < 3; i++) await b.submit(prefill(`warm${i}`))
    const prefillMs = b.estimateStepMs(1, 64)
    hold(true)
    const burst = Array.from({ length: 10 }, (_, i) => b.submit(prefill(`p${i}`)).then(ok => ({ ok }), (err: unknown) => ({ err: err as OverloadedError })))
    hold(false)
    const outcomes = await Promise.all(burst)
    const refused = outcomes.flatMap(o => 'err' in o ? [o.err] : [])
    expect(refused.length).toBeGreaterThanOrEqual(5)
    for (const err of refused) expect(err.code).toBe('SHOAL_ERR_OVERLOADED')
    // Each is told a turn one prefill after the one refused before it (whole milliseconds round
    // each up), so they do not come back at once. Whether they are then taken is timing, measured
    // in docs/engine-notes.md (wave 11), not asserted here.
    const turns = refused.map(err => err.retryAfterMs!)
    for (let i = 1; i < turns.length; i++) {
      expect(turns[i]! - turns[i - 1]!).toBeGreaterThanOrEqual(Math.floor(prefillMs))
      expect(turns[i]! - turns[i - 1]!).toBeLessThanOrEqual(Math.ceil(prefillMs))
    }
  })

  it('a prefill with its own budget (the last node that could take it) queues where the batcher\'s refuses', async () => {
    const { b, hold } = await heldClockBatcher()
    for (let i = 0; i < 3; i++) await b.submit(prefill(`warm${i}`))
    hold(true)
    const plain = Array.from({ length: 10 }, (_, i) => b.submit(prefill(`p${i}`)).then(() => 'ok', (err: OverloadedError) => err.code))
    const sole = Array.from({ length: 10 }, (_, i) => b.submit(prefill(`s${i}`, 60_000)).then(() => 'ok', (err: OverloadedError) => err.code))
    hold(false)
    expect(await Promise.all(plain)).toContain('SHOAL_ERR_OVERLOADED')
    expect(await Promise.all(sole)).toEqual(Array.from({ length: 10 }, () => 'ok'))
    await expect(b.submit(prefill('bad', -1))).rejects.toThrow(/budgetMs/)
  })
})
