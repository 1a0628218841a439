/**
 * Compressed activations on a real chain: three libp2p nodes on loopback, each a stage with its own
 * engine, run whole 64-token greedy sequences with the chain opened in f32, f16 and int8. f32 stays
 * token-for-token (and logit-for-logit, via the tokens) identical to the unsplit model; f16 and
 * int8 give full sequences whose agreement with f32 is measured (and logged), not required. Every
 * hop — the middle stage included — sends the chain's encoding: the bytes on the wire shrink by
 * the encoding's ratio, and each stage's signed receipt part hashes what the next one received.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createChainTokenSource, createPipelineService } from '../../daemon/pipeline/index.ts'
import type { ActivationEncoding } from '../../daemon/pipeline/index.ts'
import type { StageEngine } from '../../daemon/engine/index.ts'
import type { GenerateEvent } from '../../daemon/service.ts'
import { buildModels, chainFrom, chainRequest, eventually, holderOf, referenceTokens, runSource, startStage, startWholeEngine, stopHost } from './fixture.ts'
import type { Models, StageHost } from './fixture.ts'
import { makeSigner } from '../ledger/fixtures/keys.ts'

const N = 64
const prompts = [
  [1, 17, 300, 42, 42, 9, 250, 11],
  [1, 400, 3, 77, 150, 12, 8, 99, 61, 200, 201, 202, 7, 7, 7, 31, 18, 490, 2, 64],
]

let models: Models
let whole: StageEngine
let hosts: StageHost[]
const want: number[][] = []

beforeAll(async () => {
  models = await buildModels()
  whole = await startWholeEngine(models)
  for (const p of prompts) want.push(await referenceTokens(whole, p, N))
  const L = models.manifest.shape.numLayers
  const ranges: Array<[number, number]> = [[0, L / 2 - 1], [L / 2, L - 2], [L - 1, L - 1]]
  hosts = []
  for (const r of ranges) {
    const signer = makeSigner()
    hosts.push(await startStage(models.three, r, { signer: { peerId: signer.peerId, secretKey: signer.secretKey } }))
  }
}, 120_000)

afterAll(async () => {
  for (const h of hosts ?? []) await stopHost(h)
  await whole?.stop()
  await models?.cleanup()
})

/** Tokens equal at the same position, and the length of the common prefix (after the first difference the contexts differ). */
function agreement (a: number[], b: number[]): { same: number, prefix: number } {
  let prefix = 0
  while (prefix < a.length && a[prefix] === b[prefix]) prefix++
  return { same: a.filter((t, i) => t === b[i]).length / a.length, prefix }
}

async function run (activations: ActivationEncoding): Promise<{ tokens: number[][], sent: number[], parts: Array<Array<Record<string, any>>> }> {
  const [coord, ...rest] = hosts
  const before = hosts.map(h => h.stage.node.stats().bytesSent)
  const tokens: number[][] = []
  const parts: Array<Array<Record<string, any>>> = []
  for (const [i, p] of prompts.entries()) {
    const src = createChainTokenSource({
      node: coord!.stage.node, requestId: `${activations}-${i}`, sampling: { temperature: 0, topP: 1 }, deadline: Date.now() + 60_000,
      formChain: chainFrom(coord!, () => rest.map(h => holderOf(h))), activations,
    })
    try {
      tokens.push(await runSource(src, p, N, AbortSignal.timeout(60_000)))
      parts.push(await src.finish(AbortSignal.timeout(5_000)))
    } finally {
      await src.close()
    }
  }
  for (const h of hosts) await eventually(() => h.stage.node.stats(), v => v.served === 0 && v.watched === 0)
  return { tokens, sent: hosts.map((h, i) => h.stage.node.stats().bytesSent - before[i]!), parts }
}

describe('a 3-stage chain with compressed activations', () => {
  const results = new Map<ActivationEncoding, Awaited<ReturnType<typeof run>>>()

  it('f32 (the default, exact) gives the unsplit model\'s tokens', async () => {
    const r = await run('f32')
    expect(r.tokens).toEqual(want)
    results.set('f32', r)
    // Every stage measured its decode step time (what it gossips for chain formation).
    for (const h of hosts) expect(h.stage.node.stepMs()).toBeGreaterThan(0)
  }, 120_000)

  it.each(['f16', 'int8'] as const)('%s gives whole sequences; agreement with f32 is measured; every hop sends it', async (enc) => {
    const r = await run(enc)
    const f32 = results.get('f32')!
    for (const [i, t] of r.tokens.entries()) {
      expect(t).toHaveLength(N)
      const a = agreement(t, f32.tokens[i]!)
      console.log(`${enc} prompt ${i}: ${(100 * a.same).toFixed(1)} % of positions agree with f32, first ${a.prefix} of ${N} identical`)
      expect(a.same).toBeGreaterThanOrEqual(0)
    }
    // The coordinator's and the middle stage's bytes shrink by the encoding's ratio (f16: 2 of 4
    // bytes a value; int8: 1 of 4 plus a 4-byte scale a row); the ~30 bytes of each frame's header
    // (and the open/finish frames) weigh on 64-wide rows, hence the slack above.
    const ratio = enc === 'f16' ? 0.5 : 0.25
    for (const hop of [0, 1]) {
      expect(r.sent[hop]! / f32.sent[hop]!).toBeGreaterThan(ratio)
      expect(r.sent[hop]! / f32.sent[hop]!).toBeLessThan(ratio + 0.15)
    }
    // Receipts stay consistent: what the middle stage says it produced is what the last received.
    for (const parts of r.parts) {
      const byLayers = (first: number): Record<string, any> => parts.find(p => p.body?.layers?.[0] === first)!
      const L = models.manifest.shape.numLayers
      expect(byLayers(L / 2).body.outputHash).toBe(byLayers(L - 1).body.inputHash)
    }
  }, 120_000)
})

describe('negotiation per chain', () => {
  it('a coordinator asking for f16 opens the chain f16 only when every stage declares it accepts f16, else f32', async () => {
    const [coord, ...rest] = hosts
    let declare = false
    const holders = (): ReturnType<typeof holderOf>[] => rest.map(h => ({ ...holderOf(h), ...(declare ? { activations: ['f16', 'int8'] } : {}) }))
    const service = createPipelineService({ stage: coord!.stage, shardDir: models.three, activations: 'f16' }, { holders })
    await service.start()
    const generate = async (id: string): Promise<{ tokens: number[], sent: number }> => {
      const before = coord!.stage.node.stats().bytesSent
      const tokens: number[] = []
      const events = service.generate(chainRequest(id, prompts[0]!, N), AbortSignal.timeout(60_000))
      for await (const e of events as AsyncIterable<GenerateEvent>) if (e.type === 'delta') tokens.push(...e.tokenIds)
      return { tokens, sent: coord!.stage.node.stats().bytesSent - before }
    }
    try {
      // Holders that declare nothing (an older build, or capabilities not yet seen): f32, exact.
      const plain = await generate('neg-undeclared')
      expect(plain.tokens).toEqual(want[0]!.slice(0, plain.tokens.length))
      declare = true
      const lossy = await generate('neg-declared')
      expect(lossy.tokens).toHaveLength(plain.tokens.length)
      expect(lossy.sent / plain.sent).toBeLessThan(0.65)
    } finally {
      await service.stop()
    }
  }, 120_000)
})
