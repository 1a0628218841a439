/**
 * The engine's static-graph path (`shoal shard --static`): which graphs a stage runs
 * (graph-choice.ts, pure), the static runner against the dynamic one on onnxruntime (greedy
 * identity over a prompt several chunks long up to a full KV budget, multi-position logits, a
 * 2-stage chain through hidden states, batch items, a clear error past the budget), and the
 * local service running the static pair in its worker — the path an NPU takes, run here on CPU.
 */
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import {
  chooseStageGraphs, createLocalService, createOnnxruntimeBackend, createStageRunner, createStaticStageRunner,
  GREEDY_PICK as greedy, needsStaticShapes, stageInfoFor, stageInfoOf,
} from '../../daemon/engine/index.ts'
import type { BackendSession, StageRunner } from '../../daemon/engine/index.ts'
import type { GenerateEvent } from '../../daemon/service.ts'
import { compileShards, type ShardManifest } from '../../shards/index.ts'
import { buildTinyModel, type TinyModel } from './tiny-model.ts'
import { referenceGreedy } from './reference-greedy.ts'

const CTX = 48
const CHUNK = 8
const tokens = (ids: number[]): { kind: 'tokens', ids: BigInt64Array } => ({ kind: 'tokens', ids: BigInt64Array.from(ids, BigInt) })
const positions = (from: number, n: number): BigInt64Array => BigInt64Array.from({ length: n }, (_, i) => BigInt(from + i))

/** Greedy tokens through one runner: the prompt in one step, then one token per step. */
async function runGreedy (r: StageRunner, seqId: string, prompt: number[], n: number): Promise<number[]> {
  r.open(seqId)
  const out: number[] = []
  let input = prompt
  let at = 0
  while (out.length < n) {
    const o = await r.step(seqId, tokens(input), positions(at, input.length), 1, greedy)
    if (o.kind !== 'token') throw new Error('expected a token')
    at += input.length
    out.push(o.id)
    input = [o.id]
  }
  await r.drop(seqId, 'free')
  return out
}

describe('graph choice (pure)', () => {
  const base = {
    modelId: 'm', static: { contextLength: 64, chunk: 16, opSet: 'standard' },
    stages: [{ index: 0, graph: 'stage-0/model.onnx', static: { prefill: 'stage-0/static-prefill.onnx', decode: 'stage-0/static-decode.onnx' } }],
  } as unknown as ShardManifest
  const bare = { modelId: 'm', stages: [{ index: 0, graph: 'stage-0/model.onnx' }] } as unknown as ShardManifest

  it('NPUs need static shapes; CPU, GPU and AUTO do not', () => {
    expect(['NPU', 'NPU.0', 'npu'].map(needsStaticShapes)).toEqual([true, true, true])
    expect(['CPU', 'GPU', 'GPU.1', 'AUTO', 'MULTI:NPU'].map(needsStaticShapes)).toEqual([false, false, false, false, false])
  })

  it('auto picks static exactly on NPU; static/dynamic as told; NPU without static graphs says how to make them', () => {
    expect(chooseStageGraphs(base, 0, 'CPU')).toEqual({ kind: 'dynamic', graph: 'stage-0/model.onnx' })
    expect(chooseStageGraphs(base, 0, 'NPU')).toEqual({ kind: 'static', prefill: 'stage-0/static-prefill.onnx', decode: 'stage-0/static-decode.onnx', contextLength: 64, chunk: 16 })
    expect(chooseStageGraphs(base, 0, 'CPU', 'static').kind).toBe('static')
    expect(chooseStageGraphs(base, 0, 'NPU', 'dynamic').kind).toBe('dynamic')
    expect(chooseStageGraphs(bare, 0, 'CPU').kind).toBe('dynamic')
    expect(() => chooseStageGraphs(bare, 0, 'NPU')).toThrow(/device NPU compiles only static shapes.*shoal shard --static/)
    expect(() => chooseStageGraphs(bare, 0, 'CPU', 'static')).toThrow(/static graphs were asked for/)
    try { chooseStageGraphs(bare, 0, 'NPU') } catch (err) { expect((err as { code?: string }).code).toBe('SHOAL_ERR_ENGINE') }
  })

  it('on static graphs the context limit is the KV budget (within the model\'s) and steps do not batch', () => {
    const info = { hasEmbedding: true, hasHead: true, layers: [0, 1] as [number, number], hiddenSize: 8, numKvHeads: 1, headDim: 8, vocabSize: 10, maxPositions: 128, batchPadding: 'right' as const }
    expect(stageInfoFor(info, chooseStageGraphs(base, 0, 'NPU'))).toMatchObject({ maxPositions: 64, batchPadding: 'none' })
    expect(stageInfoFor({ ...info, maxPositions: 32 }, chooseStageGraphs(base, 0, 'NPU')).maxPositions).toBe(32)
    expect(stageInfoFor(info, chooseStageGraphs(base, 0, 'CPU'))).toBe(info)
  })
})

describe('static runner on onnxruntime', () => {
  let model: TinyModel
  const sessions: BackendSession[] = []
  const load = async (rel: string): Promise<BackendSession> => {
    const s = await createOnnxruntimeBackend().load(join(model.shardDir, ...rel.split('/')), { device: 'CPU', threads: 1 })
    sessions.push(s)
    return s
  }
  let dynamic: StageRunner
  let fixed: StageRunner
  const prompt = Array.from({ length: 21 }, (_, i) => (i * 37 + 11) % 250)

  beforeAll(async () => {
    model = await buildTinyModel('llama', undefined, { contextLength: CTX, chunk: CHUNK })
    const st = model.manifest.stages[0]!
    dynamic = createStageRunner({ session: await load(st.graph), stage: stageInfoOf(model.manifest) })
    fixed = createStaticStageRunner({ prefill: await load(st.static!.prefill), decode: await load(st.static!.decode), stage: stageInfoOf(model.manifest), contextLength: CTX, chunk: CHUNK })
  })
  afterAll(async () => {
    for (const s of sessions) await s.close()
    await model?.cleanup()
  })

  it('greedy tokens equal the dynamic runner\'s, up to a full KV budget', async () => {
    const n = CTX - prompt.length + 1 // the last token is picked, never fed: the buffer ends full
    const want = await runGreedy(dynamic, 'd', prompt, n)
    expect(new Set(want).size).toBeGreaterThanOrEqual(6)
    expect(await runGreedy(fixed, 's', prompt, n)).toEqual(want)
  })

  it('a multi-position step returns the same last-K logits (speculative verification) and hidden states match', async () => {
    dynamic.open('d2'); fixed.open('s2')
    const a = await dynamic.step('d2', tokens(prompt), positions(0, prompt.length), 5)
    const b = await fixed.step('s2', tokens(prompt), positions(0, prompt.length), 5)
    expect(b.kind).toBe('logits')
    if (a.kind !== 'logits' || b.kind !== 'logits') throw new Error('logits expected')
    expect(b.count).toBe(5)
    let m = 0
    a.data.forEach((v, i) => { m = Math.max(m, Math.abs(v - b.data[i]!)) })
    expect(m).toBeLessThan(1e-4)
    await dynamic.drop('d2', 'free'); await fixed.drop('s2', 'free')
  })

  it('past the KV budget: SHOAL_ERR_CONTEXT_LENGTH naming the budget, before anything runs', async () => {
    fixed.open('s3')
    await fixed.step('s3', tokens(prompt), positions(0, prompt.length), 1)
    expect(fixed.stats().kvHeldBytes).toBe(2 * 4 * model.manifest.shape.numKvHeads * CTX * model.manifest.shape.headDim * 4)
    const long = Array.from({ length: CTX - prompt.length + 1 }, () => 3)
    await expect(fixed.step('s3', tokens(long), positions(prompt.length, long.length), 1)).rejects.toMatchObject({
      code: 'SHOAL_ERR_CONTEXT_LENGTH', message: expect.stringMatching(/KV budget is 48 \(shoal shard --static\)/),
    })
    await fixed.drop('s3', 'free')
    expect(fixed.stats().liveSequences).toBe(0)
  })

  it('stepBatch runs items one at a time with the same results; unknown ids fail alone', async () => {
    fixed.open('b1'); fixed.open('b2')
    const r = await fixed.stepBatch([
      { seqId: 'b1', input: tokens(prompt), positions: positions(0, prompt.length), logitsToKeep: 1, pick: greedy },
      { seqId: 'nope', input: tokens([1]), positions: positions(0, 1), logitsToKeep: 1 },
      { seqId: 'b2', input: tokens(prompt.slice(0, 5)), positions: positions(0, 5), logitsToKeep: 1, pick: greedy },
    ])
    const solo = await runGreedy(dynamic, 'd4', prompt, 1)
    const solo5 = await runGreedy(dynamic, 'd5', prompt.slice(0, 5), 1)
    expect(r[0]).toEqual({ output: { kind: 'token', id: solo[0] } })
    expect(r[1]).toMatchObject({ error: { code: 'SHOAL_ERR_ENGINE' } })
    expect(r[2]).toEqual({ output: { kind: 'token', id: solo5[0] } })
    await fixed.drop('b1', 'free'); await fixed.drop('b2', 'free')
  })

  it('a 2-stage chain of static runners (hidden states between them) gives the same tokens', async () => {
    const dir = join(model.shardDir, '..', 'split')
    const m = await compileShards({ modelDir: join(model.shardDir, '..', 'ckpt'), outDir: dir, layers: [[0, 1], [2, 3]], static: { contextLength: CTX, chunk: CHUNK } })
    const runners: StageRunner[] = []
    for (const [i, st] of m.stages.entries()) {
      const ld = async (rel: string): Promise<BackendSession> => {
        const s = await createOnnxruntimeBackend().load(join(dir, ...rel.split('/')), { device: 'CPU', threads: 1 })
        sessions.push(s)
        return s
      }
      runners.push(createStaticStageRunner({ prefill: await ld(st.static!.prefill), decode: await ld(st.static!.decode), stage: stageInfoOf(m, i), contextLength: CTX, chunk: CHUNK }))
    }
    const [r0, r1] = runners as [StageRunner, StageRunner]
    r0.open('c'); r1.open('c')
    const out: number[] = []
    let input = prompt
    let at = 0
    while (out.length < 12) {
      const h = await r0.step('c', tokens(input), positions(at, input.length), 1)
      if (h.kind !== 'hidden') throw new Error('hidden expected')
      const t = await r1.step('c', { kind: 'hidden', data: h.data }, positions(at, input.length), 1, greedy)
      if (t.kind !== 'token') throw new Error('token expected')
      at += input.length
      out.push(t.id)
      input = [t.id]
    }
    expect(out).toEqual(await runGreedy(dynamic, 'd6', prompt, 12))
  })
})

describe('local service on the static graphs (the NPU path, on CPU)', () => {
  let model: TinyModel
  let svc: ReturnType<typeof createLocalService> | undefined
  beforeAll(async () => { model = await buildTinyModel('llama', undefined, { contextLength: CTX, chunk: 4 }) })
  afterAll(async () => {
    await svc?.stop()
    await model?.cleanup()
  })

  it('generates the dynamic graph\'s greedy tokens until the KV budget, then ends with length; longer prompts are refused', async () => {
    svc = createLocalService({ shardDir: model.shardDir, threads: 1, graphs: 'static' })
    await svc.start()
    expect(svc.models()[0]!.contextLength).toBe(CTX)
    const events: GenerateEvent[] = []
    const text = 'The quick brown fox jumps over the lazy dog'
    for await (const ev of svc.generate({
      requestId: 'r1', model: model.manifest.modelId, prompt: { kind: 'text', text }, maxTokens: undefined,
      sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 60_000,
    }, new AbortController().signal)) events.push(ev)
    const start = events[0] as Extract<GenerateEvent, { type: 'start' }>
    const got = events.flatMap(e => e.type === 'delta' ? e.tokenIds : [])
    const end = events.at(-1) as Extract<GenerateEvent, { type: 'end' }>
    expect(start.promptTokenIds.length).toBeGreaterThan(8)
    const want = await referenceGreedy(model.graphPath, model.manifest.shape, start.promptTokenIds, CTX - start.promptTokenIds.length)
    const eos = model.manifest.generation.eosTokenIds
    const cut = want.findIndex(t => eos.includes(t))
    expect(got).toEqual(cut < 0 ? want : want.slice(0, cut + 1))
    if (cut < 0) expect(end).toMatchObject({ type: 'end', finishReason: 'length', usage: { completionTokens: CTX - start.promptTokenIds.length } })
    // Static graphs keep no KV prefixes (the dynamic runner's left-aligned caches do).
    expect((await svc.stats()).prefix).toBeUndefined()

    const long = { kind: 'text' as const, text: 'word '.repeat(CTX) }
    const gen = svc.generate({ requestId: 'r2', model: model.manifest.modelId, prompt: long, maxTokens: 4, sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 60_000 }, new AbortController().signal)
    await expect(gen[Symbol.asyncIterator]().next()).rejects.toMatchObject({ code: 'SHOAL_ERR_CONTEXT_LENGTH' })
  })

  it('a shard without static graphs does not start on them, naming the fix', async () => {
    const plain = await buildTinyModel('llama')
    try {
      const s = createLocalService({ shardDir: plain.shardDir, threads: 1, graphs: 'static' })
      await expect(s.start()).rejects.toThrow(/shoal shard --static/)
      const npu = createLocalService({ shardDir: plain.shardDir, threads: 1, backend: 'openvino', device: 'NPU' })
      await expect(npu.start()).rejects.toThrow(/device NPU compiles only static shapes/)
    } finally {
      await plain.cleanup()
    }
  })
})
