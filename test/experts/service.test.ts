/**
 * The stage's service without a mesh: holders behind in-process links, one of them silent (it
 * never answers; only the abort signal ends its wait). Bounded waits: a holder that goes quiet is
 * either taken over by its copies once the mesh says it is gone (the link fails), or, with no
 * copy and no word from the mesh, the request fails at the step bound with a typed error — never
 * a hang. Tokens with a takeover equal those of a run on the healthy holder alone.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, expect, it } from 'vitest'
import {
  createExpertHolder, createExpertService, openExpertShards,
  type ExpertHolder, type ExpertLink, type ExpertShards,
} from '../../daemon/experts/index.ts'
import type { GenerateEvent, GenerateRequest } from '../../daemon/service.ts'
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
