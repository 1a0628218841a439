/**
 * Speculative decoding on a whole model in the local service: whole-sequence greedy identity with
 * and without speculation (K ∈ {1, 2, 4, 8} and adaptive; good, bad and self drafts; prompt
 * lookup; 4 batched streams), rejected positions rolled back by KV length, a failing drafter
 * falling back to plain decoding, seeded sampling reproducible, and the counts on /metrics.
 */
import { Registry } from 'prom-client'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createLocalService } from '../../daemon/engine/index.ts'
import type { LocalService, TokenSourceWrapper } from '../../daemon/engine/index.ts'
import { createSpeculation } from '../../daemon/speculative/index.ts'
import type { Drafter, Speculation, SpeculationCounts, SpeculationInit } from '../../daemon/speculative/index.ts'
import type { GenerateEvent, GenerateRequest } from '../../daemon/service.ts'
import { referenceGreedy } from '../engine/reference-greedy.ts'
import { buildDraftPair } from './pair.ts'
import type { DraftPairFixture } from './pair.ts'

const PROMPTS = [
  'The quick brown fox jumps over the lazy dog',
  'Once upon a time',
  'Rewrite this: the cat sat on the mat. the cat sat on the mat.',
  'abc abc abc abc',
]

let counter = 0
function request (modelId: string, config: string, over: Partial<GenerateRequest> = {}): GenerateRequest {
  return {
    requestId: `${config}#${++counter}`,
    model: modelId,
    prompt: { kind: 'text', text: PROMPTS[0]! },
    maxTokens: 40,
    sampling: { temperature: 0, topP: 1 },
    stop: [],
    deadline: Date.now() + 120_000,
    ...over,
  }
}

async function tokensOf (svc: LocalService, req: GenerateRequest): Promise<{ tokens: number[], promptIds: number[], end: GenerateEvent | undefined, start: Extract<GenerateEvent, { type: 'start' }> }> {
  const events: GenerateEvent[] = []
  for await (const ev of svc.generate(req, new AbortController().signal)) events.push(ev)
  const start = events.find(e => e.type === 'start') as Extract<GenerateEvent, { type: 'start' }>
  return {
    tokens: events.flatMap(e => e.type === 'delta' ? e.tokenIds : []),
    promptIds: start.promptTokenIds,
    end: events.find(e => e.type === 'end'),
    start,
  }
}

/** Each request names its speculation configuration in its id (`config#n`); one target worker serves them all. */
function routedWrapper (configs: Record<string, Speculation>): TokenSourceWrapper {
  return {
    async start (target) { for (const s of Object.values(configs)) await s.start!(target) },
    async stop () { for (const s of Object.values(configs)) await s.stop!() },
    wrap (ctx) {
      const s = configs[ctx.request.requestId.split('#')[0]!]
      if (s === undefined) throw new Error(`no speculation config for ${ctx.request.requestId}`)
      return s.wrap(ctx)
    },
  }
}

/** A drafter that proposes good-looking tokens, then fails. */
function failingDrafter (after: number): Drafter {
  let calls = 0
  return {
    name: 'failing',
    async open () {
      return {
        async propose ({ context }) {
          if (++calls > after) throw new Error('draft worker fell over')
          return { tokens: [context[context.length - 1]!, 1, 2] }
        },
        async close () {},
      }
    },
  }
}

describe('speculative decoding on a whole model', () => {
  let pair: DraftPairFixture
  let plain: LocalService
  let spec: LocalService
  const metrics = new Registry()
  const counts = new Map<string, SpeculationCounts[]>()
  const modelId = (): string => pair.target.manifest.modelId
  const reference = new Map<string, number[]>()

  beforeAll(async () => {
    pair = await buildDraftPair()
    const record: SpeculationInit['onRequestEnd'] = (id, c) => {
      const key = id.split('#')[0]!
      counts.set(key, [...(counts.get(key) ?? []), c])
    }
    const common = { threads: 1, maxSequences: 8, onRequestEnd: record, metrics }
    const good = (k: SpeculationInit['k']): Speculation => createSpeculation({ ...common, drafter: { draftDir: pair.goodDraftDir }, k })
    const configs: Record<string, Speculation> = {
      good1: good(1), good2: good(2), good4: good(4), good8: good(8), goodA: good('adaptive'),
      bad4: createSpeculation({ ...common, drafter: { draftDir: pair.badDraftDir }, k: 4 }),
      badA: createSpeculation({ ...common, drafter: { draftDir: pair.badDraftDir }, k: 'adaptive' }),
      self4: createSpeculation({ ...common, drafter: { draftDir: pair.target.shardDir }, k: 4 }),
      lookup4: createSpeculation({ ...common, drafter: 'prompt-lookup', k: 4 }),
      lookupA: createSpeculation({ ...common, drafter: 'prompt-lookup' }),
      failing: createSpeculation({ ...common, drafter: failingDrafter(3), k: 3 }),
    }
    // Each draft model dir loads once per config here; that is 8 small workers on a 2-core box, all idle but the one in use.
    plain = createLocalService({ shardDir: pair.target.shardDir, threads: 1, maxSequences: 8 })
    spec = createLocalService({ shardDir: pair.target.shardDir, threads: 1, maxSequences: 8, sourceWrapper: routedWrapper(configs), metrics })
    await plain.start()
    await spec.start()
    for (const text of PROMPTS) {
      const r = await tokensOf(plain, request(modelId(), 'plain', { prompt: { kind: 'text', text } }))
      reference.set(text, r.tokens)
    }
  })
  afterAll(async () => {
    await spec?.stop()
    await plain?.stop()
    await pair?.cleanup()
  })

  it('the plain reference equals an independent onnxruntime greedy loop', async () => {
    const r = await tokensOf(plain, request(modelId(), 'plain'))
    expect(r.tokens).toHaveLength(40)
    expect(r.tokens).toEqual(await referenceGreedy(pair.target.graphPath, pair.target.manifest.shape, r.promptIds, 40))
  })

  for (const config of ['good1', 'good2', 'good4', 'good8', 'goodA', 'bad4', 'badA', 'self4', 'lookup4', 'lookupA']) {
    it(`greedy tokens with speculation (${config}) equal plain decoding, whole sequence, every prompt`, async () => {
      for (const text of PROMPTS) {
        const r = await tokensOf(spec, request(modelId(), config, { prompt: { kind: 'text', text } }))
        expect(r.tokens, `${config}: ${text}`).toEqual(reference.get(text))
        expect(r.end).toMatchObject({ usage: { completionTokens: 40 } })
      }
    })
  }

  for (const config of ['goodA', 'lookupA']) {
    it(`a kept prefix is reused under speculation (${config}): a follow-up prefills only its new tokens, with plain decoding's tokens`, async () => {
      const turn1 = [...(await tokensOf(plain, request(modelId(), 'plain'))).promptIds, 7, 11, 13, 17 + counter % 50]
      const first = await tokensOf(spec, request(modelId(), config, { prompt: { kind: 'tokens', ids: turn1 } }))
      expect(first.tokens).toEqual((await tokensOf(plain, request(modelId(), 'plain', { prompt: { kind: 'tokens', ids: turn1 } }))).tokens)
      const turn2 = [...turn1, ...first.tokens, 19, 23]
      const before = (await spec.stats()).prefix!
      const second = await tokensOf(spec, request(modelId(), config, { prompt: { kind: 'tokens', ids: turn2 } }))
      const after = (await spec.stats()).prefix!
      expect(second.tokens).toEqual((await tokensOf(plain, request(modelId(), 'plain', { prompt: { kind: 'tokens', ids: turn2 } }))).tokens)
      // Turn 1's prompt was kept: only the rest of turn 2 was prefilled.
      expect(second.start.prefix?.reusedTokens).toBeGreaterThanOrEqual(turn1.length - 1)
      expect(after.missTokens - before.missTokens).toBe(turn2.length - second.start.prefix!.reusedTokens)
    })
  }

  it('plain steps between rounds run ahead in the engine worker, with plain decoding\'s tokens', async () => {
    // Prompt lookup on a prompt that does not repeat proposes rarely: most steps are plain, and
    // they hand the worker the next steps' picks as the plain decode loop does.
    const ahead = async (): Promise<number> => (await metrics.getSingleMetric('shoal_batch_steps_ahead_total')!.get()).values.reduce((a, v) => a + v.value, 0)
    const before = await ahead()
    const r = await tokensOf(spec, request(modelId(), 'lookupA', { prompt: { kind: 'text', text: PROMPTS[1]! } }))
    expect(r.tokens).toEqual(reference.get(PROMPTS[1]!))
    expect(await ahead() - before).toBeGreaterThan(10)
  })

  it('acceptance follows the draft: the target as its own draft ~ all, the ε-pair most, an unrelated model few', () => {
    const rate = (key: string): number => {
      const cs = counts.get(key) ?? []
      const d = cs.reduce((a, c) => a + c.drafted, 0)
      return d === 0 ? NaN : cs.reduce((a, c) => a + c.accepted, 0) / d
    }
    expect(rate('self4')).toBeGreaterThan(0.95)
    expect(rate('good4')).toBeGreaterThan(0.5)
    expect(rate('bad4')).toBeLessThan(0.2)
    expect(rate('good4')).toBeGreaterThan(rate('bad4'))
    // Rounds verified several drafts at once (the point): tokens per target step well above 1.
    const g = counts.get('good8')!
    const steps = g.reduce((a, c) => a + c.rounds + c.plainSteps, 0)
    expect(g.length * 39 / steps).toBeGreaterThan(1.5)
    expect(counts.get('good4')![0]!.drafter).toMatch(/^draft:/)
    expect(counts.get('lookup4')![0]!.drafter).toBe('prompt-lookup')
  })

  it('4 concurrent streams with speculation equal their plain tokens (verify steps batched together)', async () => {
    for (const config of ['good4', 'goodA', 'lookup4']) {
      const runs = await Promise.all(PROMPTS.map(async text => await tokensOf(spec, request(modelId(), config, { prompt: { kind: 'text', text } }))))
      runs.forEach((r, i) => { expect(r.tokens, `${config} stream ${i}`).toEqual(reference.get(PROMPTS[i]!)) })
    }
  })

  it('a drafter that fails mid-sequence leaves plain decoding, never a wrong token', async () => {
    const r = await tokensOf(spec, request(modelId(), 'failing'))
    expect(r.tokens).toEqual(reference.get(PROMPTS[0]!))
    const c = counts.get('failing')!.at(-1)!
    expect(c.drafterFailures).toBe(1)
    expect(c.rounds).toBe(3)
  })

  it('ends at max_tokens and the context end exactly as plain decoding does', async () => {
    for (const maxTokens of [1, 2, 3, 7]) {
      const want = (await tokensOf(plain, request(modelId(), 'plain', { maxTokens }))).tokens
      expect((await tokensOf(spec, request(modelId(), 'good8', { maxTokens }))).tokens).toEqual(want)
    }
  })

  it('a seeded sampled request reproduces with speculation', async () => {
    const sampling = { temperature: 0.9, topP: 0.95, seed: 4242 }
    const a = await tokensOf(spec, request(modelId(), 'goodA', { sampling }))
    const b = await tokensOf(spec, request(modelId(), 'goodA', { sampling }))
    const c = await tokensOf(spec, request(modelId(), 'goodA', { sampling: { ...sampling, seed: 7 } }))
    expect(a.tokens).toHaveLength(40)
    expect(b.tokens).toEqual(a.tokens)
    expect(c.tokens).not.toEqual(a.tokens)
    const l1 = await tokensOf(spec, request(modelId(), 'lookup4', { sampling }))
    expect((await tokensOf(spec, request(modelId(), 'lookup4', { sampling }))).tokens).toEqual(l1.tokens)
  })

  it('/metrics counts drafted and accepted tokens and K per model and drafter', async () => {
    const text = await metrics.metrics()
    expect(text).toMatch(/shoal_speculative_drafted_tokens_total\{model="[^"]+",drafter="draft:[^"]+"\} \d+/)
    expect(text).toMatch(/shoal_speculative_accepted_tokens_total\{model="[^"]+",drafter="prompt-lookup"\} \d+/)
    expect(text).toMatch(/shoal_speculative_k_bucket/)
    expect(text).toMatch(/shoal_speculative_drafter_failures_total\{model="[^"]+",drafter="failing"\} 1/)
  })
})
