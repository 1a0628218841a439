/**
 * Speculative decoding across pipeline chains on real libp2p nodes (loopback): one traversal per
 * verify carrying the token and its drafts, greedy acceptance at the last stage, rejected drafts
 * rolled back by each stage from the next activation's start. Whole-sequence greedy identity with
 * the unsplit model for K ∈ {1, 2, 4, 8} and adaptive, good, bad and self drafts and prompt
 * lookup, on 2- and 3-stage chains, alone and as 4 concurrent streams; sampled requests speculate
 * too (drafts as point masses at the last stage) and reproduce with their seed; the default
 * speculates beside other open requests (unlike on a whole model); a stage killed mid-verify is
 * replayed with the same tokens.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createLocalService } from '../../daemon/engine/index.ts'
import type { LocalService } from '../../daemon/engine/index.ts'
import { createChainTokenSource, createPipelineService } from '../../daemon/pipeline/index.ts'
import type { ChainSourceWrapper, PipelineService } from '../../daemon/pipeline/index.ts'
import { createSpeculation } from '../../daemon/speculative/index.ts'
import type { Drafter, Speculation, SpeculationCounts, SpeculationInit } from '../../daemon/speculative/index.ts'
import type { GenerateEvent, GenerateRequest } from '../../daemon/service.ts'
import { ChainIncompleteError, formChain } from '../../daemon/routing/index.ts'
import { holderOf, kill, runSource, startStage, stopHost } from '../pipeline/fixture.ts'
import type { StageHost } from '../pipeline/fixture.ts'
import { buildDraftPair } from './pair.ts'
import type { DraftPairFixture } from './pair.ts'
import { killingDrafter } from './killing-drafter.ts'

const PROMPTS = [
  'The quick brown fox jumps over the lazy dog',
  'Once upon a time',
  'Rewrite this: the cat sat on the mat. the cat sat on the mat.',
  'abc abc abc abc',
]
const TOKENS = 32

let counter = 0
const request = (config: string, over: Partial<GenerateRequest> = {}): GenerateRequest => ({
  requestId: `${config}#${++counter}`,
  model: 'target',
  prompt: { kind: 'text', text: PROMPTS[0]! },
  maxTokens: TOKENS,
  sampling: { temperature: 0, topP: 1 },
  stop: [],
  deadline: Date.now() + 120_000,
  ...over,
})

async function tokensOf (svc: { generate: LocalService['generate'] }, req: GenerateRequest): Promise<number[]> {
  const out: number[] = []
  for await (const e of svc.generate(req, new AbortController().signal) as AsyncIterable<GenerateEvent>) if (e.type === 'delta') out.push(...e.tokenIds)
  return out
}

/** Proposes token 3 K times on every round: drafts to verify whatever the text. */
const alwaysDrafter: Drafter = { name: 'always', async open () { return { async propose ({ k }) { return { tokens: Array.from({ length: k }, () => 3) } }, async close () {} } } }

function routed (configs: Record<string, Speculation>): ChainSourceWrapper {
  return {
    async start (t) { for (const s of Object.values(configs)) await s.start!(t) },
    async stop () { for (const s of Object.values(configs)) await s.stop!() },
    wrapChain (ctx) { return configs[ctx.request.requestId.split('#')[0]!]!.wrapChain(ctx) },
  }
}

describe('speculative decoding on pipeline chains', () => {
  let pair: DraftPairFixture
  let local: LocalService
  const reference = new Map<string, number[]>()
  const counts = new Map<string, SpeculationCounts[]>()
  const record: SpeculationInit['onRequestEnd'] = (id, c) => { const k = id.split('#')[0]!; counts.set(k, [...(counts.get(k) ?? []), c]) }
  const configs = (): Record<string, Speculation> => {
    const common = { threads: 1, onRequestEnd: record }
    const good = (k: SpeculationInit['k']): Speculation => createSpeculation({ ...common, drafter: { draftDir: pair.goodDraftDir }, k })
    return {
      good1: good(1), good2: good(2), good4: good(4), good8: good(8), goodA: good('adaptive'),
      bad4: createSpeculation({ ...common, drafter: { draftDir: pair.badDraftDir }, k: 4 }),
      self4: createSpeculation({ ...common, drafter: { draftDir: pair.target.shardDir }, k: 4 }),
      lookup4: createSpeculation({ ...common, drafter: 'prompt-lookup', k: 4 }),
      // The default's rules, with drafts on every round (prompt lookup drafts only where text repeats).
      byDefault: createSpeculation({ ...common, drafter: alwaysDrafter, byDefault: true }),
    }
  }

  beforeAll(async () => {
    pair = await buildDraftPair()
    local = createLocalService({ shardDir: pair.target.shardDir, threads: 1 })
    await local.start()
    for (const text of PROMPTS) reference.set(text, await tokensOf(local, request('plain', { prompt: { kind: 'text', text } })))
  }, 180_000)
  afterAll(async () => {
    await local?.stop()
    await pair?.cleanup()
  })

  for (const shape of ['two', 'three'] as const) {
    describe(`${shape === 'two' ? 2 : 3}-stage chain`, () => {
      const hosts: StageHost[] = []
      let svc: PipelineService
      beforeAll(async () => {
        const dir = shape === 'two' ? pair.twoStages : pair.threeStages
        const ranges: Array<[number, number]> = shape === 'two' ? [[0, 1], [2, 3]] : [[0, 1], [2, 2], [3, 3]]
        for (const r of ranges) hosts.push(await startStage(dir, r))
        svc = createPipelineService({ stage: hosts[0]!.stage, shardDir: dir, sourceWrapper: routed(configs()) }, { holders: () => hosts.slice(1).map(h => holderOf(h)) })
        await svc.start()
      }, 180_000)
      afterAll(async () => {
        await svc?.stop()
        for (const h of hosts) await stopHost(h)
      })

      it('greedy tokens equal the unsplit model for every K, draft and prompt lookup', async () => {
        for (const config of ['good1', 'good2', 'good4', 'good8', 'goodA', 'bad4', 'self4', 'lookup4']) {
          for (const text of PROMPTS) {
            expect(await tokensOf(svc, request(config, { prompt: { kind: 'text', text } })), `${config}: ${text}`).toEqual(reference.get(text))
          }
        }
        const rate = (k: string): number => { const cs = counts.get(k)!; return cs.reduce((a, c) => a + c.accepted, 0) / cs.reduce((a, c) => a + c.drafted, 0) }
        expect(rate('self4')).toBe(1)
        expect(rate('good4')).toBeGreaterThan(0.5)
        expect(rate('bad4')).toBeLessThan(0.2)
        for (const h of hosts) expect((await h.stage.node.engine.stats()).liveSequences).toBe(0)
      }, 300_000)

      it('4 concurrent streams keep their tokens', async () => {
        for (const config of ['good4', 'goodA', 'lookup4']) {
          const runs = await Promise.all(PROMPTS.map(async text => await tokensOf(svc, request(config, { prompt: { kind: 'text', text } }))))
          runs.forEach((t, i) => { expect(t, `${config} stream ${i}`).toEqual(reference.get(PROMPTS[i]!)) })
        }
      }, 300_000)

      it('the default speculates beside another open request too (on a chain, unlike a whole model)', async () => {
        // A request held open after its start (its events not read on): the coordinator has another.
        const held = svc.generate(request('lookup4', { prompt: { kind: 'text', text: PROMPTS[1]! } }), new AbortController().signal)[Symbol.asyncIterator]()
        expect((await held.next()).value).toMatchObject({ type: 'start' })
        try {
          const text = PROMPTS[0]!
          expect(await tokensOf(svc, request('byDefault', { prompt: { kind: 'text', text } }))).toEqual(reference.get(text))
          expect(counts.get('byDefault')!.at(-1)!.drafted).toBeGreaterThan(0)
        } finally {
          await held.return!(undefined)
        }
      }, 120_000)

      it('a seeded sampled request speculates and reproduces', async () => {
        const sampling = { temperature: 0.8, topP: 0.95, seed: 99 }
        for (const config of ['good4', 'goodA', 'lookup4']) {
          const a = await tokensOf(svc, request(config, { sampling }))
          expect(await tokensOf(svc, request(config, { sampling })), config).toEqual(a)
          expect(a).toHaveLength(TOKENS)
        }
        expect(counts.get('good4')!.at(-1)!.rounds).toBeGreaterThan(0)
        expect(counts.get('good4')!.at(-1)!.accepted).toBeGreaterThan(0)
      }, 120_000)
    })
  }

  it('a stage killed mid-verify is replayed on another holder: same tokens, no error', async () => {
    const hosts = [await startStage(pair.threeStages, [0, 1]), await startStage(pair.threeStages, [2, 2]), await startStage(pair.threeStages, [3, 3]), await startStage(pair.threeStages, [3, 3])]
    const [c, d, e, spare] = hosts as [StageHost, StageHost, StageHost, StageHost]
    // Prompt lookup that kills the last stage right after its 3rd proposal: that verify meets a dead stage.
    const killing = killingDrafter(3, async () => { await kill(e) })
    const spec = createSpeculation({ drafter: killing, k: 3, onRequestEnd: record })
    const text = PROMPTS[2]!
    const promptIds = (await (async () => { for await (const ev of local.generate(request('plain', { prompt: { kind: 'text', text }, maxTokens: 1 }), new AbortController().signal)) if (ev.type === 'start') return ev.promptTokenIds; return [] })())
    const src = createChainTokenSource({
      node: c.stage.node, requestId: 'killed#1', sampling: { temperature: 0, topP: 1 }, deadline: Date.now() + 60_000,
      formChain: (exclude) => {
        const r = formChain([holderOf(c, 0), holderOf(d), holderOf(e, 1), holderOf(spare, 50)], { now: Date.now(), modelId: 'target', numLayers: 4, exclude })
        if (r.kind !== 'chain') throw new ChainIncompleteError(r.reason)
        return r.stages.map(h => ({ peerId: h.peerId, layers: [h.layers[0], h.layers[1]] }))
      },
    })
    try {
      await src.connect(AbortSignal.timeout(30_000))
      const wrapped = spec.wrapChain({ request: request('killed', { prompt: { kind: 'text', text } }), manifest: c.stage.manifest, chain: src })
      const got = await runSource(wrapped, promptIds, TOKENS, AbortSignal.timeout(60_000))
      await wrapped.close()
      expect(got).toEqual(reference.get(text))
      expect(src.replays).toBe(1)
      expect(src.route).toEqual([c.peerId, d.peerId, spare.peerId])
    } finally {
      await src.close()
      for (const h of [c, d, spare]) await stopHost(h)
    }
  }, 120_000)
})
