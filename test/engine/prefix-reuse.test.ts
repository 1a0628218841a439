/**
 * KV prefix reuse on one node (a whole-model tiny fp32 shard, ort-contrib ops: left-aligned
 * caches): kept prefixes in the stage runner, and the local service reusing them — greedy tokens
 * identical with and without reuse (alone and batched), a follow-up turn prefilling only what is
 * new since the last prompt (and, with reuseGenerated, only its new message), the byte budget held
 * under a stream of distinct prompts, and an evicted prefix never pulled from under a sequence
 * that started from it.
 */
import { Registry } from 'prom-client'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createLocalService, createOnnxruntimeBackend, createStageRunner, stageInfoOf } from '../../daemon/engine/index.ts'
import type { LocalService, LocalServiceInit, PrefixKeepingRunner, StepOutput } from '../../daemon/engine/index.ts'
import type { GenerateEvent, GenerateRequest } from '../../daemon/service.ts'
import { parseToWorker } from '../../daemon/engine/protocol.ts'
import { blockHashes, cachedTokensFor } from '../../daemon/kv/index.ts'
import { buildTinyModel, randomTokenIds } from './tiny-model.ts'
import type { TinyModel } from './tiny-model.ts'

let counter = 0
function request (model: TinyModel, ids: number[], maxTokens = 12): GenerateRequest {
  return {
    requestId: `px-${++counter}`,
    model: model.manifest.modelId,
    prompt: { kind: 'tokens', ids },
    maxTokens,
    sampling: { temperature: 0, topP: 1 },
    stop: [],
    deadline: Date.now() + 60_000,
  }
}

interface Run { tokens: number[], end: Extract<GenerateEvent, { type: 'end' }> }

async function run (svc: LocalService, req: GenerateRequest): Promise<Run> {
  const tokens: number[] = []
  let end: Run['end'] | undefined
  for await (const ev of svc.generate(req, new AbortController().signal)) {
    if (ev.type === 'delta') tokens.push(...ev.tokenIds)
    if (ev.type === 'end') end = ev
  }
  return { tokens, end: end! }
}

describe('kept-prefix messages at the worker boundary', () => {
  it('checks retain, open-from and evict', () => {
    expect(parseToWorker({ type: 'retain', id: 1, seqId: 's', key: 'k', maxLength: 5 })).toMatchObject({ type: 'retain' })
    expect(parseToWorker({ type: 'retain', id: 1, seqId: 's', key: '', maxLength: 5 })).toMatch(/non-empty/)
    expect(parseToWorker({ type: 'retain', id: 1, seqId: 's', key: 'k', maxLength: -1 })).toMatch(/maxLength/)
    expect(parseToWorker({ type: 'open-from', id: 2, seqId: 's', key: 'k', length: 3 })).toMatchObject({ type: 'open-from' })
    expect(parseToWorker({ type: 'open-from', id: 2, seqId: 's', key: 'k', length: 0 })).toMatch(/length/)
    expect(parseToWorker({ type: 'evict', id: 3, keys: ['a', 'b'] })).toMatchObject({ type: 'evict' })
    expect(parseToWorker({ type: 'evict', id: 3, keys: [1] })).toMatch(/keys/)
  })
})

describe('kept prefixes in the stage runner', () => {
  let model: TinyModel
  let runner: PrefixKeepingRunner
  beforeAll(async () => {
    model = await buildTinyModel()
    const session = await createOnnxruntimeBackend().load(model.graphPath, { device: 'CPU', threads: 1 })
    const stage = stageInfoOf(model.manifest)
    expect(stage.batchPadding).toBe('right')
    runner = createStageRunner({ session, stage, chunkSize: 64 })
  })
  afterAll(async () => { await model?.cleanup() })

  const step = async (seqId: string, ids: number[], from: number): Promise<Float32Array> => {
    const out: StepOutput = await runner.step(seqId, { kind: 'tokens', ids: BigInt64Array.from(ids, BigInt) }, BigInt64Array.from(ids.map((_, i) => BigInt(from + i))), 1)
    if (out.kind !== 'logits') throw new Error('expected logits')
    return out.data
  }

  it('a sequence opened from a kept prefix computes bit for bit what a full prefill does, even after the prefix is evicted', async () => {
    const vocab = model.manifest.shape.vocabSize
    const prompt = randomTokenIds(40, 1, vocab)
    runner.open('full')
    const want = await step('full', prompt, 0)
    await runner.drop('full', 'free')

    runner.open('a')
    await step('a', prompt.slice(0, 31), 0)
    // A one-position step (decode) that is not kept: its KV comes from another kernel.
    await step('a', [prompt[31]!], 31)
    const kept = await runner.retain('a', 'k1', 31)
    expect(kept.length).toBe(31)
    expect(runner.stats()).toMatchObject({ liveSequences: 0, keptPrefixes: 1, keptBytes: kept.bytes })

    for (const [id, length] of [['whole', 31], ['part', 24]] as const) {
      runner.openFrom(id, 'k1', length)
      // Evicted while the sequence still holds it: the sequence keeps its own reference (or copy).
      if (id === 'part') runner.evict(['k1'])
      const got = await step(id, prompt.slice(length), length)
      expect(got).toEqual(want)
      await runner.drop(id, 'free')
    }
    expect(runner.stats()).toMatchObject({ keptPrefixes: 0, keptBytes: 0 })
    expect(() => { runner.openFrom('gone', 'k1', 4) }).toThrow(/no prefix is kept/)
    // Unknown sequence: nothing kept.
    await expect(runner.retain('nobody', 'k2', 10)).resolves.toEqual({ length: 0, bytes: 0 })
  })
})

describe('prefix reuse in the local service', () => {
  let model: TinyModel
  const services: LocalService[] = []
  async function service (init: Partial<LocalServiceInit> = {}): Promise<LocalService> {
    const svc = createLocalService({ shardDir: model.shardDir, threads: 1, maxSequences: 4, ...init })
    await svc.start()
    services.push(svc)
    return svc
  }
  let plain: LocalService
  let reusing: LocalService
  let vocab: number
  const registry = new Registry()

  beforeAll(async () => {
    model = await buildTinyModel()
    vocab = model.manifest.shape.vocabSize
    plain = await service({ kvCacheBytes: 0 })
    reusing = await service({ prefixBlockSize: 8, metrics: registry })
  })
  afterAll(async () => {
    for (const s of services) await s.stop()
    await model?.cleanup()
  })

  const prefixStats = async (svc: LocalService): Promise<{ hitTokens: number, missTokens: number, bytes: number, entries: number, evictions: number }> => {
    const s = await svc.stats()
    return s.prefix!
  }

  it('reuse is off without a budget', async () => {
    expect((await plain.stats()).prefix).toBeUndefined()
  })

  it('whole-sequence greedy tokens are identical with and without reuse: same prompt, and a continuation', async () => {
    const prompt = randomTokenIds(37, 2, vocab)
    const want = await run(plain, request(model, prompt, 20))
    const first = await run(reusing, request(model, prompt, 20))
    expect(first.tokens).toEqual(want.tokens)
    const s0 = await prefixStats(reusing)
    const again = await run(reusing, request(model, prompt, 20))
    expect(again.tokens).toEqual(want.tokens)
    const s1 = await prefixStats(reusing)
    // The whole prompt but its last two positions came from the kept prefix.
    expect(s1.hitTokens - s0.hitTokens).toBe(35)
    expect(s1.missTokens - s0.missTokens).toBe(2)

    const next = [...prompt, ...want.tokens.slice(0, 7), ...randomTokenIds(9, 3, vocab)]
    const wantNext = await run(plain, request(model, next, 20))
    const gotNext = await run(reusing, request(model, next, 20))
    expect(gotNext.tokens).toEqual(wantNext.tokens)
    // Only the prompt's positions were kept (the reply's were computed by one-position steps).
    expect((await prefixStats(reusing)).hitTokens - s1.hitTokens).toBe(37)
  })

  it('without the micro-batcher too (each request steps the engine alone)', async () => {
    const solo = await service({ prefixBlockSize: 8, batching: false })
    const prompt = randomTokenIds(33, 7, vocab)
    const want = await run(plain, request(model, prompt, 12))
    expect((await run(solo, request(model, prompt, 12))).tokens).toEqual(want.tokens)
    expect((await run(solo, request(model, prompt, 12))).tokens).toEqual(want.tokens)
    expect((await solo.stats()).prefix).toMatchObject({ hitTokens: 31, missTokens: 33 + 2 })
  })

  it('with batching: concurrent requests sharing a system prefix give each its tokens alone', async () => {
    const system = randomTokenIds(29, 4, vocab)
    const prompts = [0, 1, 2, 3].map(i => [...system, ...randomTokenIds(5 + 3 * i, 10 + i, vocab)])
    const want: number[][] = []
    for (const p of prompts) want.push((await run(plain, request(model, p, 16))).tokens)
    // Warm the cache with the system prompt alone, then all four at once.
    await run(reusing, request(model, system, 4))
    const s0 = await prefixStats(reusing)
    const got = await Promise.all(prompts.map(async p => await run(reusing, request(model, p, 16))))
    expect(got.map(g => g.tokens)).toEqual(want)
    expect((await prefixStats(reusing)).hitTokens - s0.hitTokens).toBeGreaterThanOrEqual(4 * 29)
  })

  it('multi-turn: each follow-up turn prefills only what is new since the last prompt (bit-exact mode)', async () => {
    let history = randomTokenIds(21, 20, vocab)
    const entries0 = (await prefixStats(reusing)).entries
    let newTokens = 0
    for (let turn = 0; turn < 4; turn++) {
      const before = await prefixStats(reusing)
      const r = await run(reusing, request(model, history, 10))
      const wantTurn = await run(plain, request(model, history, 10))
      expect(r.tokens).toEqual(wantTurn.tokens)
      const after = await prefixStats(reusing)
      // This turn's prompt = the last turn's prompt + its reply + a new user message.
      expect(after.missTokens - before.missTokens).toBe(turn === 0 ? history.length : newTokens)
      expect(after.hitTokens - before.hitTokens).toBe(turn === 0 ? 0 : history.length - newTokens)
      const user = randomTokenIds(6 + turn, 30 + turn, vocab)
      newTokens = r.tokens.length + user.length
      history = [...history, ...r.tokens, ...user]
    }
    // Each turn's entry superseded the last one's: one conversation, one entry.
    expect((await prefixStats(reusing)).entries).toBe(entries0 + 1)
    // Its summary says it holds this conversation: a router hashing the history finds it.
    const summary = reusing.prefixSummary()!
    expect(summary.hashes.length).toBeGreaterThan(0)
    expect(summary.hashes.length).toBeLessThanOrEqual(64)
    const held = cachedTokensFor(blockHashes(summary.scope, history, summary.blockSize), new Set(summary.hashes), summary.blockSize)
    expect(held).toBeGreaterThanOrEqual(history.length / 2 - summary.blockSize)
    expect(cachedTokensFor(blockHashes(summary.scope, randomTokenIds(40, 999, vocab), summary.blockSize), new Set(summary.hashes), summary.blockSize)).toBe(0)
    expect(plain.prefixSummary()).toBeUndefined()
    // The same counts on /metrics.
    const s = await prefixStats(reusing)
    const text = await registry.metrics()
    const model0 = model.manifest.modelId
    expect(text).toContain(`shoal_kv_prefix_hit_tokens_total{model="${model0}"} ${s.hitTokens}`)
    expect(text).toContain(`shoal_kv_prefix_miss_tokens_total{model="${model0}"} ${s.missTokens}`)
    expect(text).toContain(`shoal_kv_prefix_bytes{model="${model0}"} ${s.bytes}`)
  })

  it('multi-turn with reuseGenerated: each follow-up turn prefills only its new message (and the unfed last reply token)', async () => {
    const generative = await service({ prefixBlockSize: 8, reuseGenerated: true })
    let history = randomTokenIds(21, 40, vocab)
    let newTokens = 0
    for (let turn = 0; turn < 4; turn++) {
      const before = (await generative.stats()).prefix!
      const r = await run(generative, request(model, history, 10))
      const after = (await generative.stats()).prefix!
      expect(after.missTokens - before.missTokens).toBe(turn === 0 ? history.length : newTokens)
      const user = randomTokenIds(6 + turn, 50 + turn, vocab)
      // The reply's last token was never fed back (unless it ended at EOS, which is not in the history).
      newTokens = user.length + (r.end.finishReason === 'length' ? 1 : 0)
      history = [...history, ...r.tokens, ...user]
    }
    expect((await generative.stats()).prefix!.entries).toBe(1)
  })

  it('holds its byte budget under a stream of distinct prompts, and the worker holds exactly what the index keeps', async () => {
    const stage = stageInfoOf(model.manifest)
    const perToken = 2 * (stage.layers[1] - stage.layers[0] + 1) * stage.numKvHeads * stage.headDim * 4
    const budget = perToken * 100 // room for four 24-token prompts
    const smallMetrics = new Registry()
    const small = await service({ prefixBlockSize: 8, kvCacheBytes: budget, metrics: smallMetrics })
    for (let i = 0; i < 8; i++) {
      await run(small, request(model, randomTokenIds(24, 100 + i, vocab), 8))
      const s = await small.stats()
      expect(s.prefix!.bytes).toBeLessThanOrEqual(budget)
      expect(s.engine!.keptBytes).toBe(s.prefix!.bytes)
      expect(s.engine!.keptPrefixes).toBe(s.prefix!.entries)
      expect(s.engine!.liveSequences).toBe(0)
    }
    const s = await small.stats()
    expect(s.prefix!.evictions).toBe(4)
    expect(s.prefix!.entries).toBe(4)
    expect(await smallMetrics.metrics()).toContain(`shoal_kv_prefix_evictions_total{model="${model.manifest.modelId}"} ${s.prefix!.evictions}`)
  })
})
