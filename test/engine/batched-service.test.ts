/**
 * The local service with continuous batching on a generated tiny model (fp32): concurrent
 * requests with different prompt lengths decode in shared runs and give exactly the tokens each
 * gives alone (whole 64-token sequences); requests join and leave mid-way; one aborted request
 * does not disturb the others; KV and admission slots come back; a batcher refusal surfaces
 * before the `start` event as SHOAL_ERR_OVERLOADED with retryAfterMs; load() reports the batcher.
 */
import { Registry } from 'prom-client'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createLocalService } from '../../daemon/engine/index.ts'
import type { LocalService, LocalServiceInit } from '../../daemon/engine/index.ts'
import type { GenerateEvent, GenerateRequest } from '../../daemon/service.ts'
import { buildTinyModel } from './tiny-model.ts'
import type { TinyModel } from './tiny-model.ts'

const promptOf = (n: number, salt: number): number[] => Array.from({ length: n }, (_, i) => (i * 53 + salt * 71 + 11) % 500)
const PROMPTS = [promptOf(2, 1), promptOf(6, 2), promptOf(13, 3), promptOf(13, 4), promptOf(29, 5), promptOf(300, 6)]

let counter = 0
function request (model: TinyModel, ids: number[], maxTokens = 64): GenerateRequest {
  return {
    requestId: `breq-${++counter}`,
    model: model.manifest.modelId,
    prompt: { kind: 'tokens', ids },
    maxTokens,
    sampling: { temperature: 0, topP: 1 },
    stop: [],
    deadline: Date.now() + 120_000,
  }
}

async function tokensOf (svc: LocalService, req: GenerateRequest, signal = new AbortController().signal, onToken?: (n: number) => void): Promise<number[]> {
  const tokens: number[] = []
  for await (const ev of svc.generate(req, signal)) {
    if (ev.type === 'delta') { tokens.push(...ev.tokenIds); onToken?.(tokens.length) }
  }
  return tokens
}

describe('local service with continuous batching', () => {
  let model: TinyModel
  const services: LocalService[] = []
  async function service (init: Partial<LocalServiceInit> = {}): Promise<LocalService> {
    const svc = createLocalService({ shardDir: model.shardDir, threads: 1, maxSequences: 8, ...init })
    await svc.start()
    services.push(svc)
    return svc
  }
  let alone: LocalService
  let batched: LocalService
  const registry = new Registry()
  /** Each prompt's 64 greedy tokens, one request at a time, every step a batch of one. */
  const want: number[][] = []

  beforeAll(async () => {
    model = await buildTinyModel()
    alone = await service({ batching: false })
    batched = await service({ metrics: registry })
    for (const p of PROMPTS) want.push(await tokensOf(alone, request(model, p)))
    for (const w of want) expect(w).toHaveLength(64) // no EOS: whole sequences
  })
  afterAll(async () => {
    for (const s of services) await s.stop()
    await model?.cleanup()
  })

  it('six concurrent requests (prompts of 2..300 tokens) give the tokens of each alone, in shared runs', async () => {
    const got = await Promise.all(PROMPTS.map(async p => await tokensOf(batched, request(model, p))))
    got.forEach((t, i) => { expect(t).toEqual(want[i]) })
    const sizes = (await registry.getSingleMetric('shoal_batch_size')!.get()).values as Array<{ metricName?: string, value: number }>
    const count = sizes.find(v => v.metricName === 'shoal_batch_size_count')!.value
    const sum = sizes.find(v => v.metricName === 'shoal_batch_size_sum')!.value
    console.log(`batched service: ${count} runs, mean batch ${(sum / count).toFixed(2)} sequences`)
    expect(sum / count).toBeGreaterThan(1.5)
    expect(await batched.stats()).toMatchObject({ activeRequests: 0, engine: { liveSequences: 0, kvBytes: 0, kvHeldBytes: 0 } })
  })

  it('requests join and leave mid-way (different lengths, staggered starts) and stay exact', async () => {
    const lengths = [10, 64, 30, 50]
    const first = PROMPTS.slice(0, 4).map(async (p, i) => await tokensOf(batched, request(model, p, lengths[i])))
    // Two more join once the first has finished, while the others are mid-sequence.
    const late = first[0]!.then(async () => await Promise.all([4, 2].map(async i => await tokensOf(batched, request(model, PROMPTS[i]!)))))
    const [early, joined] = await Promise.all([Promise.all(first), late])
    early.forEach((t, i) => { expect(t).toEqual(want[i]!.slice(0, lengths[i])) })
    expect(joined).toEqual([want[4], want[2]])
    expect(await batched.stats()).toMatchObject({ activeRequests: 0, engine: { liveSequences: 0, kvBytes: 0 } })
  })

  it('aborting one request in a batch leaves the others exact and frees everything', async () => {
    const ctl = new AbortController()
    const victim = tokensOf(batched, request(model, PROMPTS[1]!), ctl.signal, n => { if (n === 20) ctl.abort() })
    const others = [0, 2, 3].map(async i => await tokensOf(batched, request(model, PROMPTS[i]!)))
    await expect(victim).rejects.toMatchObject({ code: 'SHOAL_ERR_ABORTED' })
    const got = await Promise.all(others)
    expect(got).toEqual([want[0], want[2], want[3]])
    expect(await batched.stats()).toMatchObject({ activeRequests: 0, engine: { liveSequences: 0, kvBytes: 0, kvHeldBytes: 0 } })
    expect(batched.load()).toMatchObject({ queueDepth: 0, inFlight: 0, slots: 8, activeSequences: 0 })
    expect(batched.load().decodeTokensPerSecond).toBeGreaterThan(0)
  })

  it('a prompt the batcher cannot run within its budget is refused before start, with retryAfterMs', async () => {
    const strict = await service({ budgetMs: 0 })
    // A's 300-token prefill is in flight (prior estimate ≥ 30 ms) when B's prefill is submitted.
    const a = tokensOf(strict, request(model, PROMPTS[5]!, 8))
    // B only once A's step is queued or running: both start admission together, and on a loaded
    // machine B could otherwise reach the batcher first and find it idle.
    for (let i = 0; i < 5000; i++) {
      const l = strict.load()
      if (l.inFlight > 0 || l.queueDepth > 0) break
      await new Promise(resolve => setTimeout(resolve, 1))
    }
    const events: GenerateEvent[] = []
    const b = (async () => { for await (const ev of strict.generate(request(model, PROMPTS[0]!, 8), new AbortController().signal)) events.push(ev) })()
    const err = await b.then(() => undefined, (e: unknown) => e)
    expect(err).toMatchObject({ code: 'SHOAL_ERR_OVERLOADED' })
    expect((err as { retryAfterMs: number }).retryAfterMs).toBeGreaterThanOrEqual(1)
    expect(events).toEqual([])
    expect(await a).toEqual(want[5]!.slice(0, 8))
    expect(await strict.stats()).toMatchObject({ activeRequests: 0, engine: { liveSequences: 0, kvBytes: 0 } })
  })

  it('a prefill tells the engine how far its sequence may reach (prompt and max_tokens, within the context); decode steps do not repeat it', async () => {
    const engine = batched.engine!
    const stepBatch = engine.stepBatch.bind(engine)
    const seen: Array<{ positions: number, reach: number | undefined }> = []
    engine.stepBatch = async (items, signal) => {
      for (const it of items) seen.push({ positions: it.positions.length, reach: it.reach })
      return await stepBatch(items, signal)
    }
    try {
      expect(await tokensOf(batched, request(model, PROMPTS[2]!, 20))).toEqual(want[2]!.slice(0, 20))
      expect(seen.filter(s => s.positions > 1)).toEqual([{ positions: 13, reach: 13 + 20 }])
      expect(seen.filter(s => s.positions === 1 && s.reach !== undefined)).toEqual([])
      seen.length = 0
      // Without max_tokens it may reach the context's end (a request aborted after a few tokens).
      const ac = new AbortController()
      await tokensOf(batched, { ...request(model, PROMPTS[1]!), maxTokens: undefined }, ac.signal, n => { if (n >= 3) ac.abort() }).catch(() => {})
      expect(seen.filter(s => s.positions > 1)).toEqual([{ positions: 6, reach: model.manifest.shape.maxPositions }])
    } finally {
      engine.stepBatch = stepBatch
    }
  })
})
