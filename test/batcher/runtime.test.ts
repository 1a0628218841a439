/**
 * The batcher's runtime against the SimulatedExecutor (a stand-in engine: no weights): callers get
 * their own results, batches form under concurrency, long prefills are chunked and joined back,
 * abort leaves the queue, executor failures stay within their batch. No timing assertions.
 */
import { Registry } from 'prom-client'
import { afterEach, describe, expect, it } from 'vitest'
import { createBatcher, createSequentialExecutor } from '../../daemon/batcher/index.ts'
import type { BatchExecutor, Batcher, BatcherInit, StepEngine, StepRequest, StepResult } from '../../daemon/batcher/index.ts'
import { GREEDY_PICK } from '../../daemon/engine/index.ts'
import { ShoalError } from '../../daemon/errors.ts'
import { SIM_VOCAB, SimulatedExecutor, rowsOf, seqHash } from './simulated-executor.ts'

const started: Batcher[] = []
afterEach(async () => { await Promise.all(started.splice(0).map(b => b.stop())) })

async function make (executor: SimulatedExecutor, init: BatcherInit = {}, metrics?: Registry): Promise<Batcher> {
  const b = createBatcher({ limits: { maxBatch: 4, maxPositions: 16, maxQueueDelayMs: 2, prefillAgingMs: 20 }, ...init }, { executor, ...(metrics === undefined ? {} : { metrics }) })
  await b.start()
  started.push(b)
  return b
}

const range = (from: number, n: number): number[] => Array.from({ length: n }, (_, i) => from + i)
const tokensOf = (seq: number, positions: number[]): number[] => positions.map(p => (seq * 1000 + p) % 50_000)

/** The logits rows the simulated engine gives a token step's last `keep` positions. */
function expectLogits (result: StepResult, seqId: string, positions: number[], tokenIds: number[], keep: number): void {
  const r = rowsOf(result)
  expect(r.kind).toBe('logits')
  expect(r.count).toBe(keep)
  const want: number[] = []
  for (let i = positions.length - keep; i < positions.length; i++) want.push(seqHash(seqId), positions[i]!, tokenIds[i]!, 0)
  expect(Array.from(r.data)).toEqual(want)
  if (r.kind === 'logits') expect(r.vocab).toBe(SIM_VOCAB)
}

async function codeOf (p: Promise<unknown>): Promise<string | undefined> {
  try { await p; return undefined } catch (err) { return (err as { code?: string }).code }
}

describe('batcher runtime', () => {
  it('gives concurrent submitters their own results, in batches within the limits', async () => {
    const sim = new SimulatedExecutor({ fixedMs: 1, perTokenMs: 0.02 })
    const b = await make(sim)
    const sequences = 10
    await Promise.all(range(0, sequences).map(async (seq) => {
      const seqId = `seq-${seq}`
      const promptLen = 3 + (seq % 5) * 4 // ragged prompts, some chunked (> 16)
      let positions = range(0, promptLen)
      let tokenIds = tokensOf(seq, positions)
      expectLogits(await b.submit({ seqId, kind: 'prefill', input: { tokenIds }, positions }), seqId, positions, tokenIds, 1)
      for (let step = 0; step < 6; step++) {
        positions = [promptLen + step]
        tokenIds = tokensOf(seq, positions)
        expectLogits(await b.submit({ seqId, kind: 'decode', input: { tokenIds }, positions }), seqId, positions, tokenIds, 1)
      }
      b.release(seqId)
    }))
    expect(sim.maxConcurrentRuns).toBe(1)
    for (const batch of sim.batches) {
      expect(batch.length).toBeLessThanOrEqual(4)
      expect(batch.reduce((sum, i) => sum + i.positions.length, 0)).toBeLessThanOrEqual(16)
      expect(new Set(batch.map(i => i.seqId)).size).toBe(batch.length)
    }
    // Batches form: far fewer runs than steps, and some carry several sequences' decodes.
    const steps = sim.batches.flat().length
    expect(sim.batches.length).toBeLessThan(steps)
    expect(sim.batches.some(batch => batch.filter(i => i.kind === 'decode').length >= 2)).toBe(true)
    expect(b.load().queueDepth).toBe(0)
  })

  it('chunks a long prefill to maxPositions, in order, alongside decodes, and joins the outputs', async () => {
    const sim = new SimulatedExecutor()
    const b = await make(sim)
    const positions = range(0, 50)
    const tokenIds = tokensOf(7, positions)
    sim.hold() // let the decodes and the prefill queue up together
    const first = b.submit({ seqId: 'warm', kind: 'decode', input: { tokenIds: [1] }, positions: [0] })
    const long = b.submit({ seqId: 'long', kind: 'prefill', input: { tokenIds }, positions, logitsToKeep: 20 })
    const decodes = range(0, 3).map(i => b.submit({ seqId: `d${i}`, kind: 'decode', input: { tokenIds: [i] }, positions: [9] }))
    sim.release()
    await first
    expectLogits(await long, 'long', positions, tokenIds, 20)
    for (const [i, d] of decodes.entries()) expectLogits(await d, `d${i}`, [9], [i], 1)

    const chunks = sim.batches.flat().filter(i => i.seqId === 'long')
    expect(chunks.map(c => c.positions.length).every(n => n <= 16)).toBe(true)
    expect(chunks.flatMap(c => c.positions)).toEqual(positions) // contiguous, in order, each once
    expect(chunks.map(c => c.final)).toEqual(chunks.map((_, i) => i === chunks.length - 1))
    // Decodes did not wait for the whole prefill: they shared its first run.
    const withDecodes = sim.batches.find(batch => batch.some(i => i.seqId === 'long'))!
    expect(withDecodes.filter(i => i.kind === 'decode').length).toBe(3)
  })

  it('takes at most batchCap() sequences per run when the owner caps it below maxBatch, read at every plan', async () => {
    const sim = new SimulatedExecutor()
    let cap = 2
    const b = createBatcher({ limits: { maxBatch: 4, maxPositions: 16, maxQueueDelayMs: 2, prefillAgingMs: 20 } }, { executor: sim, batchCap: () => cap })
    await b.start()
    started.push(b)
    sim.hold()
    const first = range(0, 6).map(i => b.submit({ seqId: `c${i}`, kind: 'decode', input: { tokenIds: [i] }, positions: [3] }))
    sim.release()
    for (const [i, r] of (await Promise.all(first)).entries()) expectLogits(r, `c${i}`, [3], [i], 1)
    expect(Math.max(...sim.batches.map(batch => batch.length))).toBe(2)
    // A cap at or above maxBatch (or none that makes sense) leaves maxBatch in force.
    cap = 100
    sim.batches.length = 0
    sim.hold()
    const second = range(0, 6).map(i => b.submit({ seqId: `c${i}`, kind: 'decode', input: { tokenIds: [i] }, positions: [4] }))
    sim.release()
    await Promise.all(second)
    // Past the old cap, within maxBatch (how the six split depends on when the first plan ran: a
    // loaded machine once gave 3 + 3, not 4 + 2).
    const widest = Math.max(...sim.batches.map(batch => batch.length))
    expect(widest).toBeGreaterThan(2)
    expect(widest).toBeLessThanOrEqual(4)
  })

  it('passes a pick to the final chunk only and gives back the one token', async () => {
    const sim = new SimulatedExecutor()
    const b = await make(sim)
    const positions = range(0, 40)
    const pick = GREEDY_PICK
    const [long, decode] = await Promise.all([
      b.submit({ seqId: 'long', kind: 'prefill', input: { tokenIds: tokensOf(3, positions) }, positions, pick }),
      b.submit({ seqId: 'd', kind: 'decode', input: { tokenIds: [5] }, positions: [12], pick }),
    ])
    expect(long).toEqual({ kind: 'token', id: seqHash('long') + 39 })
    expect(decode).toEqual({ kind: 'token', id: seqHash('d') + 12 })
    const chunks = sim.batches.flat().filter(i => i.seqId === 'long')
    expect(chunks.length).toBeGreaterThan(1)
    expect(chunks.map(c => c.picks)).toEqual(chunks.map(c => c.final))
  })

  it('passes a greedy verify (and its ahead picks) only to a step that runs whole: one cut into chunks gives back its logits', async () => {
    const sim = new SimulatedExecutor()
    const b = await make(sim)
    const ahead = [GREEDY_PICK, GREEDY_PICK]
    const short = range(30, 5)
    expect(await b.submit({ seqId: 'v', kind: 'decode', input: { tokenIds: tokensOf(1, short) }, positions: short, logitsToKeep: 5, verify: 'greedy', ahead })).toEqual({ kind: 'verdict', accepted: 3, id: seqHash('v') + 34 })
    expect(sim.batches.flat().filter(i => i.seqId === 'v').map(i => [i.verify, i.ahead])).toEqual([[true, 2]])
    // Past maxPositions (16) the planner cuts it: no chunk is a verify, and the rows come back whole.
    const long = range(30, 20)
    const r = rowsOf(await b.submit({ seqId: 'w', kind: 'decode', input: { tokenIds: tokensOf(2, long) }, positions: long, logitsToKeep: 20, verify: 'greedy', ahead }))
    expect(r.count).toBe(20)
    expect(Array.from(r.data.filter((_, i) => i % SIM_VOCAB === 1))).toEqual(long)
    const chunks = sim.batches.flat().filter(i => i.seqId === 'w')
    expect(chunks.length).toBeGreaterThan(1)
    expect(chunks.every(c => !c.verify && c.ahead === undefined)).toBe(true)
  })

  it('chunks hidden-state rows and joins them back', async () => {
    const sim = new SimulatedExecutor()
    const b = await make(sim)
    const width = 3
    const positions = range(5, 40)
    const hidden = Float32Array.from({ length: positions.length * width }, (_, i) => i / 10)
    const r = rowsOf(await b.submit({ seqId: 'stage2', kind: 'prefill', input: { hidden }, positions }))
    expect(r.kind).toBe('hidden')
    expect(r.count).toBe(positions.length)
    expect(Array.from(r.data)).toEqual(Array.from(hidden.map(v => v + 1)))
    expect(sim.batches.length).toBe(3) // 16 + 16 + 8
  })

  it('removes an aborted waiter from the queue; the executor never sees it', async () => {
    const sim = new SimulatedExecutor()
    const b = await make(sim)
    sim.hold()
    const running = b.submit({ seqId: 'a', kind: 'decode', input: { tokenIds: [1] }, positions: [0] })
    const ac = new AbortController()
    const waiting = b.submit({ seqId: 'b', kind: 'decode', input: { tokenIds: [2] }, positions: [0] }, ac.signal)
    expect(b.load().queueDepth).toBe(1)
    ac.abort()
    expect(await codeOf(waiting)).toBe('SHOAL_ERR_ABORTED')
    expect(b.load().queueDepth).toBe(0)
    // The signal's own coded reason wins.
    const ac2 = new AbortController()
    const waiting2 = b.submit({ seqId: 'c', kind: 'decode', input: { tokenIds: [2] }, positions: [0] }, ac2.signal)
    ac2.abort(new ShoalError('SHOAL_ERR_DEADLINE', 'stream deadline'))
    expect(await codeOf(waiting2)).toBe('SHOAL_ERR_DEADLINE')
    sim.release()
    await running
    expect(sim.batches.flat().map(i => i.seqId)).toEqual(['a'])
    // The sequence can step again after its abort.
    await b.submit({ seqId: 'b', kind: 'decode', input: { tokenIds: [2] }, positions: [0] })
  })

  it('fails an aborted in-flight step when its run returns, and drops its remaining chunks', async () => {
    const sim = new SimulatedExecutor()
    const b = await make(sim)
    sim.hold()
    const ac = new AbortController()
    const long = b.submit({ seqId: 'long', kind: 'prefill', input: { tokenIds: range(0, 40) }, positions: range(0, 40) }, ac.signal)
    await Promise.resolve()
    ac.abort()
    sim.release()
    expect(await codeOf(long)).toBe('SHOAL_ERR_ABORTED')
    expect(sim.batches.length).toBe(1)
    expect(b.load().queueDepth).toBe(0)
  })

  it('fails only the items of a failed batch, with a typed error', async () => {
    const sim = new SimulatedExecutor({
      failRun: items => items.some(i => i.seqId === 'bad') ? new Error('session.run blew up') : undefined,
      failItem: item => item.seqId === 'bad-item' ? new ShoalError('SHOAL_ERR_CONTEXT_LENGTH', 'too long') : undefined,
    })
    const b = await make(sim)
    sim.hold()
    const first = b.submit({ seqId: 'x', kind: 'decode', input: { tokenIds: [1] }, positions: [0] })
    const bad = b.submit({ seqId: 'bad', kind: 'decode', input: { tokenIds: [1] }, positions: [0] })
    const mate = b.submit({ seqId: 'y', kind: 'decode', input: { tokenIds: [1] }, positions: [0] })
    sim.release()
    await first
    const err = await bad.catch((e: unknown) => e as ShoalError)
    expect(err).toMatchObject({ code: 'SHOAL_ERR_ENGINE', name: 'BatchFailedError' })
    expect(await codeOf(mate)).toBe('SHOAL_ERR_ENGINE') // same batch
    // Later batches are fine, and a per-item error fails only that item.
    const [one, two] = await Promise.allSettled([
      b.submit({ seqId: 'bad-item', kind: 'decode', input: { tokenIds: [1] }, positions: [1] }),
      b.submit({ seqId: 'z', kind: 'decode', input: { tokenIds: [1] }, positions: [1] }),
    ])
    expect(one.status === 'rejected' && (one.reason as ShoalError).code).toBe('SHOAL_ERR_CONTEXT_LENGTH')
    expect(two.status).toBe('fulfilled')
  })

  it('refuses malformed steps and a second step for a busy sequence', async () => {
    const b = await make(new SimulatedExecutor())
    const bad: Array<Partial<StepRequest>> = [
      { seqId: '', kind: 'decode', input: { tokenIds: [1] }, positions: [0] },
      { seqId: 'a', kind: 'decode', input: { tokenIds: [1, 2] }, positions: [0] },
      { seqId: 'a', kind: 'decode', input: { hidden: new Float32Array(5) }, positions: [0, 1] },
      { seqId: 'a', kind: 'decode', input: { tokenIds: [] }, positions: [] },
      { seqId: 'a', kind: 'decode', input: { tokenIds: [1] }, positions: [-1] },
      { seqId: 'a', kind: 'prefill', input: { tokenIds: [1] }, positions: [0], logitsToKeep: 2 },
      { seqId: 'a', kind: 'prefill', input: { tokenIds: [1, 2] }, positions: [0, 1], logitsToKeep: 2, pick: GREEDY_PICK },
      { seqId: 'a', kind: 'prefill', input: { tokenIds: [1, 2] }, positions: [0, 1], reach: -1 },
      { seqId: 'a', kind: 'prefill', input: { tokenIds: [1, 2] }, positions: [0, 1], reach: 2.5 },
    ]
    for (const step of bad) expect(await codeOf(b.submit(step as StepRequest))).toBe('SHOAL_ERR_BAD_REQUEST')
    const ok = b.submit({ seqId: 'a', kind: 'decode', input: { tokenIds: [1] }, positions: [0] })
    expect(await codeOf(b.submit({ seqId: 'a', kind: 'decode', input: { tokenIds: [1] }, positions: [1] }))).toBe('SHOAL_ERR_BAD_REQUEST')
    await ok
  })

  it('stops: queued steps fail SHOAL_ERR_SHUTTING_DOWN, the running batch is aborted, new steps refused', async () => {
    const sim = new SimulatedExecutor({ fixedMs: 10_000 })
    const b = await make(sim)
    const running = b.submit({ seqId: 'a', kind: 'decode', input: { tokenIds: [1] }, positions: [0] })
    const queued = b.submit({ seqId: 'b', kind: 'decode', input: { tokenIds: [1] }, positions: [0] })
    await b.stop()
    expect(await codeOf(queued)).toBe('SHOAL_ERR_SHUTTING_DOWN')
    expect(await codeOf(running)).toBe('SHOAL_ERR_SHUTTING_DOWN')
    expect(await codeOf(b.submit({ seqId: 'c', kind: 'decode', input: { tokenIds: [1] }, positions: [0] }))).toBe('SHOAL_ERR_SHUTTING_DOWN')
  })

  it('reports load and fills its metrics in the registry it is given', async () => {
    const registry = new Registry()
    const sim = new SimulatedExecutor()
    const b = await make(sim, { name: 'stage0' }, registry)
    await Promise.all(range(0, 6).map(i => b.submit({ seqId: `s${i}`, kind: 'decode', input: { tokenIds: [i] }, positions: [3] })))
    const load = b.load()
    expect(load).toMatchObject({ queueDepth: 0, inFlight: 0 })
    expect(load.decodeTokensPerSecond).toBeGreaterThan(0)
    expect(load.expectedWaitMs).toBe(0)
    const text = await registry.metrics()
    expect(text).toMatch(/shoal_batch_size_count\{batcher="stage0"\} [1-9]/)
    expect(text).toMatch(/shoal_batch_queue_delay_seconds_count\{batcher="stage0",kind="decode"\} 6/)
    expect(text).toMatch(/shoal_batch_step_seconds_count\{batcher="stage0"\} [1-9]/)
    expect(text).toContain('shoal_batch_config{batcher="stage0",setting="max_queue_delay_seconds"} 0.002')
    expect(text).toContain('shoal_batch_config{batcher="stage0",setting="budget_seconds"} 1')
  })

  it('drives an unbatched stage engine through createSequentialExecutor (one engine step per item)', async () => {
    const calls: Array<{ seqId: string, positions: number[], logitsToKeep: number | undefined }> = []
    // A stand-in with the stage engine's step signature (the real engine is tested in test/engine).
    const engine: StepEngine = {
      async step (seqId, input, positions, options, signal) {
        calls.push({ seqId, positions, logitsToKeep: options?.logitsToKeep })
        if (seqId === 'too-long') throw new ShoalError('SHOAL_ERR_CONTEXT_LENGTH', 'context limit')
        expect(signal).toBeInstanceOf(AbortSignal)
        const ids = 'tokenIds' in input ? input.tokenIds : []
        const k = options?.logitsToKeep ?? 1
        return { kind: 'logits', data: Float32Array.from(ids.slice(-k)), count: k, vocab: 1 }
      },
    }
    const b = createBatcher({ limits: { maxBatch: 4, maxPositions: 8 } }, { executor: createSequentialExecutor(engine) })
    await b.start()
    started.push(b)
    const [long, bad] = await Promise.allSettled([
      b.submit({ seqId: 'long', kind: 'prefill', input: { tokenIds: range(100, 12) }, positions: range(0, 12), logitsToKeep: 6 }),
      b.submit({ seqId: 'too-long', kind: 'decode', input: { tokenIds: [1] }, positions: [9999] }),
    ])
    expect(long.status === 'fulfilled' && Array.from(rowsOf(long.value).data)).toEqual(range(106, 6))
    expect(bad.status === 'rejected' && (bad.reason as ShoalError).code).toBe('SHOAL_ERR_CONTEXT_LENGTH')
    // The 12-position prefill ran as chunks, asking each for the logits rows it contributes.
    expect(calls.filter(c => c.seqId === 'long').map(c => [c.positions.length, c.logitsToKeep])).toEqual([[8, 2], [4, 4]])
  })
  it('passes a step\'s ahead picks to the executor (a prefill\'s on its final chunk), and its step-time model learns nothing from results computed ahead', async () => {
    const pick = GREEDY_PICK
    const seen: Array<{ kind: string, ahead: number | undefined, positions?: number }> = []
    // A stand-in executor: prefills "run" (wall time passes), decodes come back computed ahead.
    const executor: BatchExecutor = {
      async run (items) {
        for (const it of items) seen.push({ kind: it.kind, ahead: it.ahead?.length })
        if (items.every(it => it.kind === 'decode')) return items.map(() => ({ output: { kind: 'token', id: 7 }, ranAhead: true }))
        await new Promise(resolve => setTimeout(resolve, 20))
        // A chunk that more chunks follow has no pick: its logits, which the batcher drops.
        return items.map(it => ({ output: it.pick === undefined ? { kind: 'logits', data: new Float32Array(it.logitsToKeep), count: it.logitsToKeep, vocab: 1 } : { kind: 'token', id: 5 } }))
      },
    }
    const b = createBatcher({ limits: { maxBatch: 4, maxPositions: 16, maxQueueDelayMs: 0, prefillAgingMs: 20 } }, { executor })
    await b.start()
    started.push(b)
    await b.submit({ seqId: 's', kind: 'prefill', input: { tokenIds: [1, 2, 3] }, positions: [0, 1, 2], pick, ahead: [pick] })
    const afterPrefill = b.estimateStepMs(1, 1)
    expect(afterPrefill).toBeGreaterThan(0)
    for (let i = 0; i < 20; i++) await b.submit({ seqId: 's', kind: 'decode', input: { tokenIds: [5] }, positions: [3 + i], pick, ahead: [pick, pick] })
    // Twenty instant results taught it nothing: without the check its estimate would fall towards 0.
    expect(b.estimateStepMs(1, 1)).toBe(afterPrefill)
    expect(b.load().decodeTokensPerSecond).toBeGreaterThan(0)
    // Ahead picks ride on decode steps, and on a prefill: on its final chunk alone, the one with the pick.
    expect(seen[0]).toEqual({ kind: 'prefill', ahead: 1 })
    expect(seen.slice(1).every(x => x.kind === 'decode' && x.ahead === 2)).toBe(true)
    seen.length = 0
    await b.submit({ seqId: 't', kind: 'prefill', input: { tokenIds: Array.from({ length: 20 }, (_, i) => i + 1) }, positions: Array.from({ length: 20 }, (_, i) => i), pick, ahead: [pick, pick, pick] })
    expect(seen).toEqual([{ kind: 'prefill', ahead: undefined }, { kind: 'prefill', ahead: 3 }])
  })

  it('estimates a decode run from decode runs alone, however many prefills ran since', async () => {
    // Decode runs cost 10 ms whatever their size, prefill runs 5 ms a position (the clock is the
    // executor's: each run moves it by its cost).
    let now = 0
    const executor: BatchExecutor = {
      async run (items) {
        now += items.every(it => it.kind === 'decode') ? 10 : 5 * items.reduce((n, it) => n + it.positions.length, 0)
        return items.map(() => ({ output: { kind: 'token', id: 5 } }))
      },
    }
    const pick = GREEDY_PICK
    const b = createBatcher({ limits: { maxBatch: 4, maxPositions: 64, maxQueueDelayMs: 0 } }, { executor, clock: { now: () => now } })
    await b.start()
    started.push(b)
    const seqs = ['a', 'b', 'c', 'd']
    for (const seqId of seqs) await b.submit({ seqId, kind: 'prefill', input: { tokenIds: range(1, 16) }, positions: range(0, 16), pick })
    for (let i = 0; i < 20; i++) await Promise.all(seqs.map(seqId => b.submit({ seqId, kind: 'decode', input: { tokenIds: [5] }, positions: [16 + i], pick })))
    // A burst of prompts arrives: sixteen prefill runs, nothing decoded meanwhile.
    for (let i = 0; i < 16; i++) await b.submit({ seqId: `p${i}`, kind: 'prefill', input: { tokenIds: range(1, 48) }, positions: range(0, 48), pick })
    expect(b.estimateStepMs(4)).toBeGreaterThan(9)
    expect(b.estimateStepMs(4)).toBeLessThan(11)
    // The whole-run model still prices prefills.
    expect(b.estimateStepMs(1, 48)).toBeGreaterThan(200)
  })

  it('learns from the runs the executor timed, once each, ahead or not, instead of its own wall time', async () => {
    // Each batch takes 30 ms of the batcher's clock (a round trip beside other work); the run that
    // computed its result took 2 ms where it ran. Later, two rows' runs whose results come in two
    // batches each (as a run ahead's do): the second batch names the same run, with a time that
    // must not count again.
    let now = 0
    let batches = 0
    let rows = 1
    const executor: BatchExecutor = {
      async run (items) {
        now += 30
        batches++
        const run = rows === 1
          ? { id: batches, rows: 1, positions: 1, ms: 2 }
          : { id: 1000 + Math.ceil(batches / 2), rows: 2, positions: 2, ms: batches % 2 === 1 ? 4 : 400 }
        return items.map(() => ({ output: { kind: 'token', id: 5 }, ranAhead: true, run }))
      },
    }
    const pick = GREEDY_PICK
    const b = createBatcher({ limits: { maxBatch: 4, maxPositions: 64, maxQueueDelayMs: 0 } }, { executor, clock: { now: () => now } })
    await b.start()
    started.push(b)
    for (let i = 0; i < 10; i++) await b.submit({ seqId: 's', kind: 'decode', input: { tokenIds: [5] }, positions: [16 + i], pick })
    expect(b.estimateStepMs(1)).toBeCloseTo(2, 9)
    expect(b.fastestDecodeMs()).toBe(2)
    rows = 2
    batches = 0
    for (let i = 0; i < 10; i++) await b.submit({ seqId: 's', kind: 'decode', input: { tokenIds: [5] }, positions: [26 + i], pick })
    expect(b.estimateStepMs(2)).toBeCloseTo(4, 9)
    expect(b.estimateStepMs(1)).toBeCloseTo(2, 9)
  })

  it('keeps the fastest one-sequence decode run it timed, not the runs computed ahead', async () => {
    // One sequence: a cold first decode run of 30 ms, then 4 ms runs, then results computed ahead
    // (the executor had them: no time, not a run). The clock is the executor's, as above.
    let now = 0
    let runs = 0
    const executor: BatchExecutor = {
      async run (items) {
        runs++
        const ahead = runs > 8
        if (!ahead) now += items[0]!.kind === 'prefill' ? 50 : runs === 2 ? 30 : 4
        return items.map(() => ahead ? { output: { kind: 'token', id: 5 }, ranAhead: true as const } : { output: { kind: 'token', id: 5 } })
      },
    }
    const pick = GREEDY_PICK
    const b = createBatcher({ limits: { maxBatch: 4, maxPositions: 64, maxQueueDelayMs: 0 } }, { executor, clock: { now: () => now } })
    await b.start()
    started.push(b)
    expect(b.fastestDecodeMs()).toBe(0)
    await b.submit({ seqId: 's', kind: 'prefill', input: { tokenIds: range(1, 16) }, positions: range(0, 16), pick })
    expect(b.fastestDecodeMs()).toBe(0) // a prefill is not a decode step
    for (let i = 0; i < 12; i++) await b.submit({ seqId: 's', kind: 'decode', input: { tokenIds: [5] }, positions: [16 + i], pick })
    expect(b.fastestDecodeMs()).toBe(4)
    // The model of those runs reads the cold one too.
    expect(b.estimateStepMs(1)).toBeGreaterThan(4)
  })
})
