/**
 * The stage engine across its worker boundary: results equal the in-process runner's, errors keep
 * their {name, code}, malformed messages get typed error replies, cancel frees the KV, and the
 * sequence bound holds.
 */
import { once } from 'node:events'
import { Worker } from 'node:worker_threads'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import {
  createOnnxruntimeBackend, createStageEngine, createStageRunner, DeadlineError, ENGINE_PROTOCOL_VERSION,
} from '../../daemon/engine/index.ts'
import type { BatchingStageEngine, StageInfo } from '../../daemon/engine/index.ts'
import { int64Of, parseToWorker } from '../../daemon/engine/protocol.ts'
import type { FromWorker, WorkerInit } from '../../daemon/engine/protocol.ts'
import { startTinyEngine } from './tiny-model.ts'
import type { TinyEngine, TinyModel } from './tiny-model.ts'

const range = (n: number, from = 0): number[] => Array.from({ length: n }, (_, i) => from + i)
const prompt = [3, 99, 41, 250, 7, 7, 300, 12, 8, 77, 150, 2]

describe('engine worker protocol (pure)', () => {
  it('rejects malformed messages with a reason', () => {
    expect(parseToWorker(null)).toMatch(/not an object/)
    expect(parseToWorker({ type: 'open', seqId: 'a' })).toMatch(/integer id/)
    expect(parseToWorker({ type: 'nope', id: 1 })).toMatch(/unknown message type/)
    expect(parseToWorker({ type: 'open', id: 1, seqId: '' })).toMatch(/seqId/)
    expect(parseToWorker({ type: 'step', id: 1, seqId: 's', input: { kind: 'tokens', ids: [1, 2] }, positions: new BigInt64Array(2), logitsToKeep: 1 })).toMatch(/input must be/)
    expect(parseToWorker({ type: 'step', id: 1, seqId: 's', input: { kind: 'tokens', ids: new BigInt64Array(2) }, positions: [0, 1], logitsToKeep: 1 })).toMatch(/positions/)
    expect(parseToWorker({ type: 'step', id: 1, seqId: 's', input: { kind: 'tokens', ids: new BigInt64Array(2) }, positions: new BigInt64Array(2), logitsToKeep: 0 })).toMatch(/logitsToKeep/)
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ seqId: 's', input: { kind: 'tokens', ids: new BigInt64Array(1) }, positions: new BigInt64Array(1), logitsToKeep: 1, reach: -2 }] })).toMatch(/reach/)
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ seqId: 's', input: { kind: 'tokens', ids: new BigInt64Array(1) }, positions: new BigInt64Array(1), logitsToKeep: 1, reach: 40 }] })).toMatchObject({ type: 'step-batch' })
    expect(parseToWorker({ type: 'stats', id: 3 })).toEqual({ type: 'stats', id: 3 })
  })

  it('writes ids and positions as int64, exactly, and refuses what is not an integer', () => {
    expect(int64Of([0, 5, -3, 2 ** 40, Number.MAX_SAFE_INTEGER])).toEqual(BigInt64Array.of(0n, 5n, -3n, 2n ** 40n, 9007199254740991n))
    expect(int64Of([])).toEqual(new BigInt64Array(0))
    expect(() => int64Of([1.5])).toThrow(RangeError)
  })
})

describe('stage engine in a worker', () => {
  let tiny: TinyEngine | undefined
  let model: TinyModel
  let stage: StageInfo
  let engine: BatchingStageEngine

  beforeAll(async () => {
    tiny = await startTinyEngine({ threads: 1, maxSequences: 2, chunkSize: 64 })
    ;({ model, stage, engine } = tiny)
  })
  afterAll(async () => {
    await tiny?.stop()
  })

  it('gives exactly the in-process runner\'s logits, prefill and decode', async () => {
    const session = await createOnnxruntimeBackend().load(model.graphPath, { device: 'CPU', threads: 1 })
    const runner = createStageRunner({ session, stage, chunkSize: 64 })
    runner.open('local')
    const want1 = await runner.step('local', { kind: 'tokens', ids: BigInt64Array.from(prompt, BigInt) }, BigInt64Array.from(range(prompt.length), BigInt), 3)
    const want2 = await runner.step('local', { kind: 'tokens', ids: BigInt64Array.of(5n) }, BigInt64Array.of(BigInt(prompt.length)), 1)
    await session.close()

    const seq = await engine.open()
    const got1 = await engine.step(seq, { tokenIds: prompt }, range(prompt.length), { logitsToKeep: 3 })
    const got2 = await engine.step(seq, { tokenIds: [5] }, [prompt.length])
    expect(got1).toEqual(want1)
    expect(got1).toMatchObject({ kind: 'logits', count: 3, vocab: stage.vocabSize })
    expect(got2).toEqual(want2)
    const stats = await engine.stats()
    expect(stats.sequences[seq]).toBe(prompt.length + 1)
    expect(stats.kvBytes).toBe(2 * (stage.layers[1] + 1) * stage.numKvHeads * (prompt.length + 1) * stage.headDim * 4)
    await engine.free(seq)
    expect(await engine.stats()).toMatchObject({ liveSequences: 0, kvBytes: 0 })
  })

  it('keeps error names and codes across the boundary', async () => {
    await expect(engine.step('nope', { tokenIds: [1] }, [0])).rejects.toMatchObject({ name: 'EngineError', code: 'SHOAL_ERR_ENGINE' })
    const a = await engine.open('a')
    await expect(engine.open('a')).rejects.toMatchObject({ code: 'SHOAL_ERR_ENGINE' })
    const b = await engine.open('b')
    // The worker holds its maximum: the open is not waited for, so the sequence's first step says so.
    const third = await engine.open('c')
    await expect(engine.step(third, { tokenIds: [1] }, [0])).rejects.toMatchObject({ name: 'OverloadedError', code: 'SHOAL_ERR_OVERLOADED' })
    await engine.free(third)
    await expect(engine.step(a, { hidden: new Float32Array(stage.hiddenSize) }, [0])).rejects.toMatchObject({ code: 'SHOAL_ERR_ENGINE' })
    await expect(engine.step(b, { tokenIds: [1, 2] }, [0])).rejects.toMatchObject({ code: 'SHOAL_ERR_ENGINE' })
    // a failed step ends its sequence (its cache state is unknown)
    expect((await engine.stats()).liveSequences).toBe(0)
    const c = await engine.open('c')
    await expect(engine.step(c, { tokenIds: range(stage.maxPositions + 1, 0).map(i => i % 500) }, range(stage.maxPositions + 1)))
      .rejects.toMatchObject({ name: 'ContextLengthError', code: 'SHOAL_ERR_CONTEXT_LENGTH' })
    expect((await engine.stats()).liveSequences).toBe(0)
  })

  it('opens without waiting for the worker: a live id is refused at once, a refused open fails only its own first step', async () => {
    const x = await engine.open('x')
    const y = await engine.open('y')
    await expect(engine.open('x')).rejects.toMatchObject({ name: 'EngineError', message: expect.stringMatching(/already open/) })
    // Past the worker's maximum of two: 'z' opens here, and its step in a batch fails alone.
    const z = await engine.open('z')
    const prefill = (seqId: string) => ({ seqId, input: { tokenIds: prompt }, positions: range(prompt.length) })
    const first = await engine.stepBatch([prefill(x), prefill(z), prefill(y)])
    expect(first[1]).toMatchObject({ error: { name: 'OverloadedError', code: 'SHOAL_ERR_OVERLOADED' } })
    expect(first[0]).toEqual(first[2])
    // The refused id is the caller's until freed; then it opens (and runs) like any other.
    await expect(engine.open('z')).rejects.toMatchObject({ message: expect.stringMatching(/already open/) })
    await engine.free(z)
    await engine.free(y)
    const again = await engine.open('z')
    const [viaX, viaZ] = await engine.stepBatch([
      { seqId: x, input: { tokenIds: [5] }, positions: [prompt.length] },
      prefill(again),
    ])
    expect(viaX).not.toHaveProperty('error')
    // The same logits; the worker's turns (`run`) are other ones.
    expect(viaZ).toEqual({ ...first[0], run: expect.objectContaining({ rows: 2 }) })
    await engine.free(x)
    await engine.free(again)
    expect(await engine.stats()).toMatchObject({ liveSequences: 0, kvBytes: 0 })
  })

  it('cancel mid-prefill rejects with the signal\'s reason and frees the KV', async () => {
    const long = range(1500).map(i => (i * 7) % 500)
    const seq = await engine.open()
    await engine.step(seq, { tokenIds: long.slice(0, 100) }, range(100))
    expect((await engine.stats()).kvBytes).toBeGreaterThan(0)
    const ctl = new AbortController()
    const pending = engine.step(seq, { tokenIds: long.slice(100) }, range(1400, 100), {}, ctl.signal)
    // Aborting right away still lands mid-run: the worker starts the first chunk before it reads
    // the cancel, and drops the sequence at the next chunk boundary.
    ctl.abort()
    await expect(pending).rejects.toMatchObject({ code: 'SHOAL_ERR_ABORTED' })
    expect(await engine.stats()).toMatchObject({ liveSequences: 0, kvBytes: 0 })

    // a deadline reason is kept as it is
    const seq2 = await engine.open()
    const ctl2 = new AbortController()
    ctl2.abort(new DeadlineError())
    await expect(engine.step(seq2, { tokenIds: [1] }, [0], {}, ctl2.signal)).rejects.toMatchObject({ code: 'SHOAL_ERR_DEADLINE' })
    expect(await engine.stats()).toMatchObject({ liveSequences: 0, kvBytes: 0 })
    // the engine still works afterwards
    const seq3 = await engine.open()
    await expect(engine.step(seq3, { tokenIds: [1] }, [0])).resolves.toMatchObject({ kind: 'logits' })
    await engine.free(seq3)
  })

  it('answers malformed raw messages with typed error replies', async () => {
    const data: WorkerInit = { version: ENGINE_PROTOCOL_VERSION, backend: 'onnxruntime', graphPath: model.graphPath, device: 'CPU', threads: 1, stage, maxSequences: 1, chunkSize: 64 }
    const w = new Worker(new URL('../../daemon/engine/worker.ts', import.meta.url), { workerData: data })
    try {
      const [ready] = await once(w, 'message') as [FromWorker]
      expect(ready).toMatchObject({ type: 'ready', version: ENGINE_PROTOCOL_VERSION })
      w.postMessage({ type: 'bogus', id: 7 })
      const [reply] = await once(w, 'message') as [FromWorker]
      expect(reply).toMatchObject({ type: 'error', id: 7, error: { name: 'EngineError', code: 'SHOAL_ERR_ENGINE' } })
      w.postMessage({ type: 'step', id: 8, seqId: 's', input: { kind: 'tokens', ids: [1] }, positions: [0], logitsToKeep: 1 })
      const [reply2] = await once(w, 'message') as [FromWorker]
      expect(reply2).toMatchObject({ type: 'error', id: 8, error: { code: 'SHOAL_ERR_ENGINE' } })
    } finally {
      await w.terminate()
    }
  })

  it('a graph that cannot load fails start() with a typed error', async () => {
    const bad = createStageEngine({ graphPath: `${model.graphPath}.missing`, stage, threads: 1 })
    await expect(bad.start()).rejects.toMatchObject({ code: 'SHOAL_ERR_ENGINE' })
    await expect(bad.open()).rejects.toMatchObject({ code: 'SHOAL_ERR_ENGINE' })
  })
})
