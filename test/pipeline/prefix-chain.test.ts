/**
 * KV prefix reuse on pipeline chains (real stage nodes on loopback, the tiny fp32 model split in 2
 * and 3 stages): greedy tokens with reuse identical to a cold run of the unsplit model over whole
 * sequences; a repeated prompt and a follow-up turn prefill only what is new (counted); with
 * reuseGenerated a follow-up turn prefills only its new message; a stage that evicted the prefix
 * within its own budget answers so and the request is prefilled whole, with the same tokens; the
 * same under speculative decoding, whose rejected drafts are never kept; and every stage ends
 * holding no live sequence, only kept prefixes.
 */
import { Registry } from 'prom-client'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createLocalService } from '../../daemon/engine/index.ts'
import type { LocalService } from '../../daemon/engine/index.ts'
import { createLocalChain, createPipelineService } from '../../daemon/pipeline/index.ts'
import type { PipelineService, PipelineServiceInit } from '../../daemon/pipeline/index.ts'
import type { GenerateEvent, GenerateRequest } from '../../daemon/service.ts'
import { createSpeculation } from '../../daemon/speculative/index.ts'
import type { Drafter } from '../../daemon/speculative/index.ts'
import { buildModels, chainRequest, eventually, holderOf, startStage, stopHost } from './fixture.ts'
import type { Models, StageHost } from './fixture.ts'

const MIB = 1024 * 1024

let models: Models
let cold: LocalService
let counter = 0

beforeAll(async () => {
  models = await buildModels()
  // The reference: the unsplit model with prefix reuse off (every prompt prefilled whole).
  cold = createLocalService({ shardDir: models.whole, threads: 1, kvCacheBytes: 0 })
  await cold.start()
}, 120_000)
afterAll(async () => {
  await cold?.stop()
  await models?.cleanup()
})

const request = (ids: number[], maxTokens = 24): GenerateRequest => chainRequest(`pc-${++counter}`, ids, maxTokens)

interface Run { tokens: number[], start: Extract<GenerateEvent, { type: 'start' }>, end: Extract<GenerateEvent, { type: 'end' }> }

async function run (svc: { generate: LocalService['generate'] }, req: GenerateRequest): Promise<Run> {
  const tokens: number[] = []
  let start: Run['start'] | undefined
  let end: Run['end'] | undefined
  for await (const ev of svc.generate(req, new AbortController().signal)) {
    if (ev.type === 'start') start = ev
    if (ev.type === 'delta') tokens.push(...ev.tokenIds)
    if (ev.type === 'end') end = ev
  }
  return { tokens, start: start!, end: end! }
}

/** Deterministic pseudo-random token ids in [3, 512). */
function tokens (n: number, seed: number): number[] {
  let x = seed * 2654435761 >>> 0
  return Array.from({ length: n }, () => { x = (x * 1103515245 + 12345) >>> 0; return 3 + (x >>> 8) % 509 })
}

function rangesOf (stages: number): Array<[number, number]> {
  const L = models.manifest.shape.numLayers
  return stages === 2 ? [[0, L / 2 - 1], [L / 2, L - 1]] : [[0, L / 2 - 1], [L / 2, L - 2], [L - 1, L - 1]]
}

/** KV bytes per position of a stage holding `layers` of the tiny model (key and value, f32). */
function bytesPerToken (layers: [number, number]): number {
  const s = models.manifest.shape
  return 2 * (layers[1] - layers[0] + 1) * s.numKvHeads * (s.hiddenSize / s.numHeads) * 4
}

async function startChain (stages: number, budgets: (layers: [number, number], i: number) => number): Promise<StageHost[]> {
  const dir = stages === 2 ? models.two : models.three
  const hosts: StageHost[] = []
  for (const [i, r] of rangesOf(stages).entries()) hosts.push(await startStage(dir, r, { kvCacheBytes: budgets(r, i) }))
  return hosts
}

async function startService (hosts: StageHost[], stages: number, over: Partial<PipelineServiceInit> = {}): Promise<PipelineService> {
  const svc = createPipelineService({ stage: hosts[0]!.stage, shardDir: stages === 2 ? models.two : models.three, prefixBlockSize: 8, ...over }, { holders: () => hosts.slice(1).map(h => holderOf(h)) })
  await svc.start()
  return svc
}

/** Prompt positions a request prefilled, and those it took from a kept prefix. */
async function counted<T> (svc: PipelineService, f: () => Promise<T>): Promise<{ value: T, miss: number, hit: number }> {
  const before = svc.stats().prefix!
  const value = await f()
  const after = svc.stats().prefix!
  return { value, miss: after.missTokens - before.missTokens, hit: after.hitTokens - before.hitTokens }
}

/** Every stage holds no live sequence (kept prefixes stay), and serves or watches nothing. */
async function settled (hosts: StageHost[]): Promise<void> {
  for (const h of hosts) {
    expect(await eventually(() => h.stage.node.engine.stats(), s => s.liveSequences === 0)).toMatchObject({ liveSequences: 0 })
    expect(await eventually(() => h.stage.node.stats(), s => s.served === 0 && s.watched === 0)).toMatchObject({ served: 0, watched: 0 })
  }
}

describe.each([
  { name: '2-stage', stages: 2 },
  { name: '3-stage', stages: 3 },
])('prefix reuse on a $name chain', ({ stages }) => {
  let hosts: StageHost[] = []
  let service: PipelineService
  const registry = new Registry()

  beforeAll(async () => {
    hosts = await startChain(stages, () => 64 * MIB)
    // A generous bound on the wait for the stages' keeps, so a loaded machine does not decide the reuse asserted below.
    service = await startService(hosts, stages, { metrics: registry, keptWaitMs: 5_000 })
  }, 60_000)
  afterAll(async () => {
    await service?.stop()
    for (const h of hosts) await stopHost(h)
  })

  it('gives a cold run\'s greedy tokens; a repeated prompt and a follow-up turn prefill only what is new', async () => {
    const a = tokens(40, stages)
    const first = await counted(service, () => run(service, request(a)))
    expect(first.value.start.prefix).toBeUndefined()
    expect(first.miss).toBe(a.length)
    const want = await run(cold, request(a))
    expect(first.value.tokens).toEqual(want.tokens)
    expect(new Set(want.tokens).size).toBeGreaterThan(4)
    await settled(hosts)
    // Every stage kept the prompt's KV.
    for (const h of hosts) expect((await h.stage.node.engine.stats()).keptPrefixes).toBe(1)

    // The same prompt again: all but the last two positions come from the chain's kept prefix.
    const again = await counted(service, () => run(service, request(a)))
    expect(again.value.start.prefix?.reusedTokens).toBeGreaterThan(0)
    expect(again.value.start.route).toEqual(hosts.map(h => h.peerId))
    expect(again.hit).toBe(a.length - 2)
    expect(again.miss).toBe(2)
    expect(again.value.tokens).toEqual(want.tokens)

    // Turn 2 of a chat: the history, the reply and a new message; only the reply and message run.
    const b = [...a, ...first.value.tokens, ...tokens(7, 100 + stages)]
    const turn2 = await counted(service, () => run(service, request(b)))
    expect(turn2.value.start.prefix?.reusedTokens).toBeGreaterThan(0)
    expect(turn2.hit).toBe(a.length)
    expect(turn2.miss).toBe(b.length - a.length)
    expect(turn2.value.tokens).toEqual((await run(cold, request(b))).tokens)
    // Turn 2's prompt superseded turn 1's in the index; the start of both is kept once on stage 0.
    expect(service.stats().prefix!.entries).toBe(1)
    await settled(hosts)
    expect((await hosts[0]!.stage.node.engine.stats()).keptPrefixes).toBe(1)
    // The other stages drop turn 1's copy with the chain's next finish.
    for (const h of hosts.slice(1)) expect((await h.stage.node.engine.stats()).keptPrefixes).toBe(2)
    expect((await run(service, request(b))).tokens).toEqual(turn2.value.tokens)
    for (const h of hosts) expect(await eventually(() => h.stage.node.engine.stats(), s => s.keptPrefixes === 1)).toMatchObject({ keptPrefixes: 1 })
    await settled(hosts)

    const text = await registry.metrics()
    const s = service.stats().prefix!
    expect(text).toContain(`shoal_kv_prefix_hit_tokens_total{model="chain-test"} ${s.hitTokens}`)
    expect(text).toContain(`shoal_kv_prefix_miss_tokens_total{model="chain-test"} ${s.missTokens}`)
  }, 120_000)

  it('samples a seeded request with reuse exactly as without (the last stage\'s draws do not depend on what was prefilled)', async () => {
    const p = tokens(33, 500 + stages)
    const seeded = (): GenerateRequest => ({ ...request(p), sampling: { temperature: 0.9, topP: 0.95, seed: 77 } })
    const want = (await run(cold, seeded())).tokens
    const first = await run(service, seeded())
    // Sent the moment the first response ended: the coordinator holds its open until the stages
    // have acknowledged keeping the first request's prefix.
    const again = await run(service, seeded())
    expect(first.start.prefix).toBeUndefined()
    expect(again.start.prefix?.reusedTokens).toBeGreaterThan(0)
    expect(first.tokens).toEqual(want)
    expect(again.tokens).toEqual(want)
  }, 120_000)

  it('a follow-up sent the moment a response ended waits for the stages\' keeps (a slow one too) and reuses the prefix', async () => {
    // The last stage's keep is slowed as a busy engine worker would slow it: its part (and so the
    // response's end) goes out before the keep is done, and the follow-up's open reaches that stage
    // first unless the coordinator waits for the stage to acknowledge the keep.
    const engine = hosts.at(-1)!.stage.node.engine as unknown as { retain: (...a: unknown[]) => Promise<unknown> }
    const retain = engine.retain
    engine.retain = async (...a) => { await new Promise(resolve => setTimeout(resolve, 150)); return await retain.apply(engine, a) }
    try {
      const a = tokens(40, 700 + stages)
      const b = [...a, ...tokens(6, 710 + stages)]
      const wantA = (await run(cold, request(a))).tokens
      const wantB = (await run(cold, request(b))).tokens
      const first = await counted(service, () => run(service, request(a)))
      const next = await counted(service, () => run(service, request(b)))
      expect(first.value.tokens).toEqual(wantA)
      expect(next.value.start.prefix?.reusedTokens).toBe(a.length)
      expect(next.hit).toBe(a.length)
      expect(next.miss).toBe(b.length - a.length)
      expect(next.value.tokens).toEqual(wantB)
    } finally {
      engine.retain = retain
    }
    await settled(hosts)
  }, 120_000)

  it('concurrent requests sharing a kept prefix (their steps batched at every stage) each give the cold run\'s tokens', async () => {
    const a = tokens(40, stages)
    const prompts = [0, 1, 2].map(i => [...a, ...tokens(5 + i, 200 + i)])
    const want = await Promise.all(prompts.map(async p => (await run(cold, request(p))).tokens))
    const got = await Promise.all(prompts.map(async p => await run(service, request(p))))
    for (const [i, r] of got.entries()) {
      expect(r.start.prefix?.reusedTokens).toBeGreaterThan(0)
      expect(r.tokens).toEqual(want[i])
    }
    await settled(hosts)
  }, 120_000)

  it('works under speculative decoding: a cold run\'s tokens, a repeated prompt reused, a kept reply without its rejected drafts', async () => {
    // Drafts that are nearly always wrong: every verify leaves rejected columns on every stage past
    // the accepted ones, which the next round rolls back. A request that ends on a stop string
    // ends after such a verify, its last rejected columns still there.
    const wrong: Drafter = { name: 'wrong', async open () { return { async propose ({ k }) { return { tokens: Array.from({ length: k }, () => 3) } }, async close () {} } } }
    const drafted: number[] = []
    const spec = createSpeculation({ drafter: wrong, k: 4, onRequestEnd: (_id, c) => { drafted.push(c.drafted) } })
    const wrapped = await startService(hosts, stages, { sourceWrapper: spec, reuseGenerated: true, keptWaitMs: 5_000 })
    try {
      const p = tokens(40, 300 + stages)
      // A stop string from the cold run's text, a few tokens in.
      const texts: string[] = []
      for await (const e of cold.generate(request(p), new AbortController().signal)) if (e.type === 'delta') texts.push(e.text)
      const stop = texts.slice(8, 11).join('')
      expect(stop.length).toBeGreaterThan(0)
      const stopping = (ids: number[]): GenerateRequest => ({ ...request(ids), stop: [stop] })
      const want = await run(cold, stopping(p))
      expect(want.end.finishReason).toBe('stop')
      const first = await counted(wrapped, () => run(wrapped, stopping(p)))
      expect(first.value.tokens).toEqual(want.tokens)
      expect(first.value.end.finishReason).toBe('stop')
      expect(first.miss).toBe(p.length)
      await settled(hosts)
      // The same prompt again: every stage opens from the kept prompt (and reply).
      const again = await counted(wrapped, () => run(wrapped, stopping(p)))
      expect(again.value.start.prefix?.reusedTokens).toBeGreaterThan(0)
      expect(again.value.tokens).toEqual(want.tokens)
      await settled(hosts)
      // A follow-up turn prefills its new message and the reply's last token (never fed back), not
      // less: the kept KV stops where the verified columns do, before any rejected draft's.
      const user = tokens(7, 61)
      const history = [...p, ...first.value.tokens, ...user]
      const follow = await counted(wrapped, () => run(wrapped, request(history)))
      expect(follow.miss).toBe(user.length + 1)
      expect(follow.value.tokens).toEqual((await run(cold, request(history))).tokens)
      expect(Math.min(...drafted)).toBeGreaterThan(0)
      await settled(hosts)
    } finally {
      await wrapped.stop()
    }
  }, 120_000)

  it('with reuseGenerated, each follow-up turn prefills only its new message (and the unfed last reply token)', async () => {
    const generative = await startService(hosts, stages, { reuseGenerated: true })
    try {
      let history = tokens(21, 40 + stages)
      let newTokens = 0
      for (let turn = 0; turn < 3; turn++) {
        const r = await counted(generative, () => run(generative, request(history, 10)))
        expect(r.miss).toBe(turn === 0 ? history.length : newTokens)
        expect(r.value.start.prefix === undefined).toBe(turn === 0)
        const user = tokens(6 + turn, 50 + turn)
        newTokens = user.length + (r.value.end.finishReason === 'length' ? 1 : 0)
        history = [...history, ...r.value.tokens, ...user]
      }
      await settled(hosts)
    } finally {
      await generative.stop()
    }
  }, 120_000)
})

describe('a stage that evicted the prefix (3 stages, the middle one with room for one prompt)', () => {
  let hosts: StageHost[] = []
  let service: PipelineService

  beforeAll(async () => {
    // The middle stage keeps one 40-position prompt, not two; the others keep plenty.
    hosts = await startChain(3, (layers, i) => i === 1 ? bytesPerToken(layers) * 60 : 64 * MIB)
    service = await startService(hosts, 3)
  }, 60_000)
  afterAll(async () => {
    await service?.stop()
    for (const h of hosts) await stopHost(h)
  })

  it('answers so, and the request is prefilled whole with the cold run\'s tokens; the next one reuses again', async () => {
    const p = tokens(40, 7)
    const q = tokens(40, 8)
    const want = (await run(cold, request(p))).tokens
    expect((await run(service, request(p))).tokens).toEqual(want)
    expect((await run(service, request(q))).tokens).toEqual((await run(cold, request(q))).tokens)
    await settled(hosts)
    // The middle stage evicted p's KV to keep q's; stage 0 and the last stage hold both.
    const middle = hosts[1]!.stage.node.stats().prefixes!
    expect(middle).toMatchObject({ entries: 1, evictions: 1 })
    expect(hosts[0]!.stage.node.stats().prefixes!.entries).toBe(2)

    // p again: the coordinator opens from its key, the middle stage no longer has it.
    const fallback = await counted(service, () => run(service, request(p)))
    expect(fallback.value.tokens).toEqual(want)
    expect(fallback.value.start.prefix).toBeUndefined()
    expect(fallback.miss).toBe(p.length)
    expect(fallback.hit).toBe(0)
    expect(service.stats().prefix!.refused).toBe(1)
    await settled(hosts)

    // After a refusal the chain keeps nothing for one finish (keepSkips); then p is kept again on
    // every stage and the next request reuses it.
    const whole = await counted(service, () => run(service, request(p)))
    expect(whole.value.start.prefix).toBeUndefined()
    expect(whole.value.tokens).toEqual(want)
    await settled(hosts)
    const reused = await counted(service, () => run(service, request(p)))
    expect(reused.value.start.prefix?.reusedTokens).toBeGreaterThan(0)
    expect(reused.hit).toBe(p.length - 2)
    expect(reused.value.tokens).toEqual(want)
    await settled(hosts)
  }, 120_000)
})

describe('a chain with a stage that keeps nothing (no KV budget)', () => {
  let hosts: StageHost[] = []
  let service: PipelineService

  beforeAll(async () => {
    hosts = await startChain(2, (_, i) => i === 1 ? 0 : 64 * MIB)
    service = await startService(hosts, 2)
  }, 60_000)
  afterAll(async () => {
    await service?.stop()
    for (const h of hosts) await stopHost(h)
  })

  it('gives the cold run\'s tokens every time, and tries that chain\'s prefixes ever more rarely', async () => {
    const p = tokens(40, 9)
    const want = (await run(cold, request(p, 12))).tokens
    for (let i = 0; i < 10; i++) {
      const r = await run(service, request(p, 12))
      expect(r.tokens).toEqual(want)
      expect(r.start.prefix).toBeUndefined()
    }
    // Refused at the 2nd, 4th and 8th request: after each, 1, 3, then 7 finishes keep nothing.
    expect(service.stats().prefix!.refused).toBe(3)
    expect(hosts[1]!.stage.node.stats().prefixes).toBeUndefined()
    await settled(hosts)
    expect((await hosts[1]!.stage.node.engine.stats()).keptPrefixes ?? 0).toBe(0)
  }, 120_000)
})

describe('a local chain (every stage in this process)', () => {
  it('shares its KV budget among its stages and reuses a kept prefix with the cold run\'s tokens', async () => {
    const chain = createLocalChain({ shardDir: models.three, engines: [{ backend: 'onnxruntime', device: 'CPU' }], threads: 1, kvCacheBytes: 64 * MIB })
    await chain.start()
    try {
      const L = models.manifest.shape.numLayers
      expect(chain.stages.map(s => s.node.stats().prefixes!.budgetBytes)).toEqual(rangesOf(3).map(r => Math.floor(64 * MIB * (r[1] - r[0] + 1) / L)))
      const p = tokens(30, 600)
      const want = (await run(cold, request(p))).tokens
      const first = await run(chain.service, request(p))
      const again = await run(chain.service, request(p))
      expect(first.tokens).toEqual(want)
      expect(again.tokens).toEqual(want)
      expect(again.start.prefix?.reusedTokens).toBeGreaterThan(0)
      expect(chain.service.stats().prefix).toMatchObject({ hitTokens: p.length - 2, missTokens: p.length + 2 })
    } finally {
      await chain.stop()
    }
  }, 120_000)
})

describe('the chain that keeps a prompt\'s prefix is asked for again while it is worth it', () => {
  let hosts: StageHost[] = []
  let service: PipelineService
  /** Extra RTT charged to each stage-1 holder, by peer id (what the test turns to make one dearer). */
  const extra = new Map<string, number>()

  beforeAll(async () => {
    const [first, second] = rangesOf(2)
    // Stage 0 and two holders of stage 1.
    hosts = [
      await startStage(models.two, first!, { kvCacheBytes: 64 * MIB }),
      await startStage(models.two, second!, { kvCacheBytes: 64 * MIB }),
      await startStage(models.two, second!, { kvCacheBytes: 64 * MIB }),
    ]
    service = createPipelineService({ stage: hosts[0]!.stage, shardDir: models.two, prefixBlockSize: 8 }, {
      holders: () => hosts.slice(1).map(h => holderOf(h, 1 + (extra.get(h.peerId) ?? 0))),
    })
    await service.start()
  }, 60_000)
  afterAll(async () => {
    await service?.stop()
    for (const h of hosts) await stopHost(h)
  })

  it('keeps a slightly dearer chain that holds the prefix, and leaves it when it costs more than the prefill saves', async () => {
    const [b, c] = [hosts[1]!, hosts[2]!]
    const routeOf = (r: Run): string[] => r.start.route
    // Turn 1: c is dearer, so b runs it (and keeps its KV).
    extra.set(c.peerId, 5)
    const a = tokens(200, 11)
    const t1 = await run(service, request(a, 8))
    expect(routeOf(t1)).toEqual([hosts[0]!.peerId, b.peerId])
    await settled(hosts)
    // Turn 2: b is now a little dearer than c (2 ms a token), far less than ~200 tokens of prefill: b again, reused.
    extra.set(c.peerId, 0)
    extra.set(b.peerId, 2)
    const a2 = [...a, ...t1.tokens, ...tokens(20, 12)]
    const t2 = await counted(service, () => run(service, request(a2, 8)))
    expect(routeOf(t2.value)).toEqual([hosts[0]!.peerId, b.peerId])
    expect(t2.hit).toBeGreaterThan(a.length - 2)
    expect(t2.value.tokens).toEqual((await run(cold, request(a2, 8))).tokens)
    await settled(hosts)
    // Turn 3: b is far dearer than any prefill: c runs it, cold, with the same tokens as ever.
    extra.set(b.peerId, 1e9)
    const a3 = [...a2, ...t2.value.tokens, ...tokens(20, 13)]
    const t3 = await counted(service, () => run(service, request(a3, 8)))
    expect(routeOf(t3.value)).toEqual([hosts[0]!.peerId, c.peerId])
    expect(t3.hit).toBe(0)
    expect(t3.value.tokens).toEqual((await run(cold, request(a3, 8))).tokens)
    await settled(hosts)
  }, 120_000)
})
