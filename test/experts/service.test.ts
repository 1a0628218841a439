/**
 * The stage's service without a mesh: holders behind in-process links, one of them silent (it
 * never answers; only the abort signal ends its wait). Bounded waits: a holder that goes quiet is
 * either taken over by its copies once the mesh says it is gone (the link fails), or, with no
 * copy and no word from the mesh, the request fails at the step bound with a typed error — never
 * a hang. Tokens with a takeover equal those of a run on the healthy holder alone. Receipt parts:
 * an honest holder's signed part rides the end event; one that claims other work than the stage
 * exchanged with it (re-signed with its own key) is left out.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, expect, it } from 'vitest'
import {
  createExpertHolder, createExpertService, openExpertShards,
  type ExpertHolder, type ExpertLink, type ExpertShards,
} from '../../daemon/experts/index.ts'
import { createReceiptPart, verifyReceiptPart, type SignedReceiptPart } from '../../daemon/ledger/index.ts'
import { decodePayload, encodePayloadParts } from '../../daemon/experts/wire.ts'
import type { GenerateEvent, GenerateRequest } from '../../daemon/service.ts'
import { makeSigner } from '../ledger/fixtures/keys.ts'
import { compileExpertShards, generateTestModel } from '../../shards/index.ts'

let root: string
let shards: ExpertShards
let holder: ExpertHolder

beforeAll(async () => {
  root = await mkdtemp(join(tmpdir(), 'shoal-expert-service-'))
  await generateTestModel({ architecture: 'qwen2-moe', outDir: join(root, 'ckpt'), seed: 4, modelId: 'moe' })
  await compileExpertShards({ modelDir: join(root, 'ckpt'), outDir: join(root, 'experts') })
  shards = await openExpertShards(join(root, 'experts'))
  holder = createExpertHolder({ dir: shards.dir, layout: shards.layout, model: shards.key, experts: [], maxExperts: shards.experts })
  await holder.start()
}, 120_000)
afterAll(async () => {
  await holder.stop()
  await rm(root, { recursive: true, force: true })
})

const request = (n: number): GenerateRequest => ({
  requestId: `r${n}`, model: 'moe', prompt: { kind: 'tokens', ids: [5, 17, 99, 230, 41, 7] }, maxTokens: 16,
  sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 60_000,
})

async function tokens (events: AsyncIterable<GenerateEvent>): Promise<number[]> {
  const ids: number[] = []
  for await (const e of events) if (e.type === 'delta') ids.push(...e.tokenIds)
  return ids
}

/** 'good' answers through the real holder; 'silent' never answers, and fails only when `lost` aborts (the mesh's word). */
function links (lost: AbortSignal): ExpertLink {
  return async (peerId, parts, signal) => {
    if (peerId === 'good') return await holder.handle(Uint8Array.from(parts.flatMap(p => [...p])))
    return await new Promise<Uint8Array>((_resolve, reject) => {
      const any = AbortSignal.any([signal, lost])
      any.addEventListener('abort', () => { reject(Object.assign(new Error('holder silent is gone'), { code: 'SHOAL_ERR_PEER_LOST' })) }, { once: true })
    })
  }
}

it('a silent holder the mesh declares gone: its copies take over and the tokens equal the healthy holder\'s alone', async () => {
  const alone = createExpertService({ shards, nodeId: 'stage' }, { holders: () => [{ peerId: 'good', freeBytes: shards.experts * shards.expertBytes }], link: links(new AbortController().signal) })
  await alone.start()
  const want = await tokens(alone.generate(request(0), new AbortController().signal))
  await alone.stop()
  expect(want.length).toBe(16)

  const lost = new AbortController()
  const all = shards.experts * shards.expertBytes
  const s = createExpertService({ shards, nodeId: 'stage' }, { holders: () => [{ peerId: 'good', freeBytes: all }, { peerId: 'silent', freeBytes: all }], link: links(lost.signal) })
  await s.start()
  try {
    // Every expert has a copy on both; the silent one's rows wait until the mesh gives up on it.
    setTimeout(() => { lost.abort() }, 300)
    expect(await tokens(s.generate(request(1), new AbortController().signal))).toEqual(want)
    expect(s.plan()!.excluded).toContain('silent')
  } finally {
    await s.stop()
  }
}, 60_000)

it('a silent holder with no copy and no word from the mesh: the request fails at the step bound with a typed error', async () => {
  const s = createExpertService({ shards, nodeId: 'stage', stepTimeoutMs: 500 }, { holders: () => [{ peerId: 'silent', freeBytes: shards.experts * shards.expertBytes }], link: links(new AbortController().signal) })
  await s.start()
  try {
    const t0 = Date.now()
    const err = await tokens(s.generate(request(2), new AbortController().signal)).then(() => undefined, (e: unknown) => e)
    expect((err as { code?: string }).code).toBe('SHOAL_ERR_PEER_LOST')
    expect((err as Error).message).toMatch(/did not answer within 500 ms/)
    expect(Date.now() - t0).toBeLessThan(10_000)
    // No holders at all: a 503-coded refusal before any work.
    const none = createExpertService({ shards, nodeId: 'stage' }, { holders: () => [], link: links(new AbortController().signal) })
    await none.start()
    const refused = await tokens(none.generate(request(3), new AbortController().signal)).then(() => undefined, (e: unknown) => e)
    expect((refused as { code?: string }).code).toBe('SHOAL_ERR_EXPERTS_UNPLACEABLE')
    await none.stop()
  } finally {
    await s.stop()
  }
}, 60_000)

it('hands up an honest holder\'s signed part with the end event, and leaves out one that claims other work', async () => {
  const honestKey = makeSigner()
  const liarKey = makeSigner()
  const signed = (key: ReturnType<typeof makeSigner>): ExpertHolder => createExpertHolder({ dir: shards.dir, layout: shards.layout, model: shards.key, modelId: 'moe', experts: [], maxExperts: shards.experts, signer: key })
  const honest = signed(honestKey)
  const liar = signed(liarKey)
  await honest.start()
  await liar.start()
  const join = (parts: Uint8Array[]): Uint8Array => Uint8Array.from(parts.flatMap(p => [...p]))
  // The liar signs a part with its own key (so its signature verifies) that claims one row more.
  const lying: ExpertLink = async (_peerId, parts) => {
    const answer = await liar.handle(join(parts))
    const f = decodePayload(answer)
    if (f.kind !== 'part' || f.part === undefined) return answer
    const body = (f.part as unknown as SignedReceiptPart).body
    const forged = createReceiptPart({ ...body, tokens: { input: body.tokens.input + 1, output: body.tokens.output + 1 } }, liarKey.secretKey)
    return join(encodePayloadParts({ kind: 'part', model: f.model, step: f.step, part: forged as unknown as Record<string, unknown> }))
  }
  const all = shards.experts * shards.expertBytes
  const run = async (peerId: string, link: ExpertLink, id: number): Promise<{ parts: unknown[], refused: number }> => {
    const s = createExpertService({ shards, nodeId: 'stage' }, { holders: () => [{ peerId, freeBytes: all }], link })
    await s.start()
    try {
      let parts: unknown[] = []
      for await (const e of s.generate(request(id), new AbortController().signal)) if (e.type === 'end') parts = e.receiptParts ?? []
      return { parts, refused: s.stats().partsRefused }
    } finally {
      await s.stop()
    }
  }
  try {
    const good = await run(honestKey.peerId, async (_p, parts) => await honest.handle(join(parts)), 10)
    expect(good.refused).toBe(0)
    expect(good.parts).toHaveLength(1)
    const part = good.parts[0] as SignedReceiptPart
    expect(verifyReceiptPart(part, honestKey.publicKey)).toBe(true)
    // 6 prompt rows and 15 fed-back tokens, at every MoE layer, all on this one holder.
    expect(part.body).toMatchObject({ requestId: 'r10', peerId: honestKey.peerId, model: 'moe', tokens: { input: 21 * shards.layout.shape.moe!.moeLayers.length } })
    expect(part.body.experts!.map(e => e.layer)).toEqual(shards.layout.shape.moe!.moeLayers)
    expect(honest.openRequests()).toBe(0)
    const bad = await run(liarKey.peerId, lying, 11)
    expect(bad.parts).toEqual([])
    expect(bad.refused).toBe(1)
  } finally {
    await honest.stop()
    await liar.stop()
  }
}, 60_000)

it('a burst past maxSequences waits for slots (tokens equal a lone run) instead of being refused; past maxWaiting it gets 429 with a retry estimate', async () => {
  const all = shards.experts * shards.expertBytes
  const components = { holders: () => [{ peerId: 'good', freeBytes: all }], link: links(new AbortController().signal) }
  const burst = (n: number): GenerateRequest => ({ ...request(20 + n), prompt: { kind: 'tokens', ids: [5 + n, 17, 99, 230 - n, 41, 7] }, maxTokens: 6 })
  const lone = createExpertService({ shards, nodeId: 'stage' }, components)
  await lone.start()
  const want: number[][] = []
  try {
    for (let i = 0; i < 6; i++) want.push(await tokens(lone.generate(burst(i), new AbortController().signal)))
  } finally {
    await lone.stop()
  }

  // 2 slots, 6 requests at once: 4 wait (the expected wait is unmeasured, so within any budget).
  const s = createExpertService({ shards, nodeId: 'stage', maxSequences: 2 }, components)
  await s.start()
  try {
    const got = await Promise.all(Array.from({ length: 6 }, async (_, i) => await tokens(s.generate(burst(i), new AbortController().signal))))
    expect(got).toEqual(want)
    expect(s.stats().activeRequests).toBe(0)
  } finally {
    await s.stop()
  }

  // 2 slots and room for 1 waiter: of 4 at once, the 4th is refused (429-coded, with Retry-After).
  const t = createExpertService({ shards, nodeId: 'stage', maxSequences: 2, maxWaiting: 1 }, components)
  await t.start()
  try {
    const out = await Promise.allSettled(Array.from({ length: 4 }, async (_, i) => await tokens(t.generate(burst(i), new AbortController().signal))))
    const refused = out.filter(o => o.status === 'rejected').map(o => (o as PromiseRejectedResult).reason as { code?: string, retryAfterMs?: number })
    expect(refused).toHaveLength(1)
    expect(refused[0]!.code).toBe('SHOAL_ERR_OVERLOADED')
    expect(refused[0]!.retryAfterMs).toBeGreaterThanOrEqual(1)
    expect(out.filter(o => o.status === 'fulfilled').map(o => (o as PromiseFulfilledResult<number[]>).value)).toEqual(want.slice(0, 3))
    expect(t.stats().activeRequests).toBe(0)
  } finally {
    await t.stop()
  }
}, 60_000)

it('concurrent sequences step together: one wave per token for all of them, not one for the first back and another for the rest', async () => {
  const all = shards.experts * shards.expertBytes
  const s = createExpertService({ shards, nodeId: 'stage', maxSequences: 4 }, { holders: () => [{ peerId: 'good', freeBytes: all }], link: links(new AbortController().signal) })
  await s.start()
  try {
    const got = await Promise.all(Array.from({ length: 4 }, async (_, i) => await tokens(s.generate({ ...request(30 + i), prompt: { kind: 'tokens', ids: [9 + i, 17, 99, 41] }, maxTokens: 8 }, new AbortController().signal))))
    const longest = Math.max(...got.map(g => g.length))
    // One expert step per MoE layer per wave; a wave per token (the prefill's included) when the
    // four step together (a little slack for a consumer slower than the gather); waves of 1 and
    // 3 would be twice that.
    const waves = s.stats().expertSteps / shards.layout.shape.moe!.moeLayers.length
    expect(waves).toBeGreaterThanOrEqual(longest)
    expect(waves).toBeLessThanOrEqual(longest + 2)
  } finally {
    await s.stop()
  }
}, 60_000)
