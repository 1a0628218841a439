/**
 * `shoal shard --experts` writes what a stage node serves (tokenizer, model id, the checkpoint's
 * hash in the layout, so the layout's hash is the key). A holder that loads experts on first use (what a daemon's holder does): within its budget it
 * keeps what frames name; past it, it releases the least recently used expert, so a stage that
 * re-planned (and now sends it another share) is served instead of refused. Answers equal a
 * holder that had the experts loaded from the start.
 */
import { createHash } from 'node:crypto'
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, expect, it } from 'vitest'
import { createExpertHolder, decodePayload, encodePayloadParts, openExpertShards } from '../../daemon/experts/index.ts'
import { verifyReceiptPart, type SignedReceiptPart } from '../../daemon/ledger/index.ts'
import { shard } from '../../scripts/commands/shard.ts'
import { makeSigner } from '../ledger/fixtures/keys.ts'
import { compileExpertShards, generateTestModel, type ExpertShardLayout } from '../../shards/index.ts'

const MODEL = 'key'
let root: string
let dir: string
let layout: ExpertShardLayout

beforeAll(async () => {
  root = await mkdtemp(join(tmpdir(), 'shoal-holder-'))
  await generateTestModel({ architecture: 'mixtral', outDir: join(root, 'ckpt'), seed: 4 })
  dir = join(root, 'experts')
  layout = await compileExpertShards({ modelDir: join(root, 'ckpt'), outDir: dir })
}, 120_000)
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

const rowsFor = (D: number): Float32Array => Float32Array.from({ length: 2 * D }, (_, i) => Math.sin(i))
const frame = (layer: number, expert: number, D: number, step: number): Uint8Array => {
  const parts = encodePayloadParts({ kind: 'compute', model: MODEL, step, layer, rows: 2, width: D, groups: [{ expert, rows: [0, 1], weights: [0.5, 0.25] }], data: rowsFor(D) })
  return Uint8Array.from(parts.flatMap(p => [...p]))
}

it('loads on first use within its budget, then releases the least recently used expert', async () => {
  const D = layout.shape.hiddenSize
  const layer = layout.shape.moe!.moeLayers[0]!
  const lazy = createExpertHolder({ dir, layout, model: MODEL, experts: [], maxExperts: 2 })
  const eager = createExpertHolder({ dir, layout, model: MODEL, experts: [0, 1, 2].map(expert => ({ layer, expert })) })
  await lazy.start()
  await eager.start()
  try {
    expect(lazy.stats().resident).toBe(0)
    for (const [step, expert] of [0, 1, 0, 2].entries()) {
      const got = decodePayload(await lazy.handle(frame(layer, expert, D, step)))
      const want = decodePayload(await eager.handle(frame(layer, expert, D, step)))
      expect(got.kind).toBe('partial')
      expect(got).toEqual(want)
    }
    // Expert 1 was the least recently used when expert 2 came: released.
    expect(lazy.resident()).toEqual([{ layer, experts: [0, 2] }])
    expect(lazy.stats().resident).toBe(2)
    // A holder without on-demand loading refuses what it does not hold.
    const refused = decodePayload(await eager.handle(frame(layer, 5, D, 9)))
    expect(refused.kind === 'error' && refused.error.code).toBe('SHOAL_ERR_EXPERTS_NOT_HELD')
  } finally {
    await lazy.stop()
    await eager.stop()
  }
}, 60_000)

it('shoal shard --experts writes expert-parallel shards a stage can serve, keyed by their layout', async () => {
  const out = join(root, 'cli-experts')
  await shard({ model: join(root, 'ckpt'), out, experts: true })
  const s = await openExpertShards(out)
  expect(s.layout.tokenizerFiles).toContain('tokenizer.json')
  expect(s.layout.sourceHash).toMatch(/^[0-9a-f]{64}$/)
  expect(s.layout.generation?.eosTokenIds.length).toBeGreaterThan(0)
  expect(s.experts).toBe(s.layout.shape.moe!.moeLayers.length * 8)
  // The same checkpoint compiled twice has one key; the stage-oriented flags do not apply.
  expect((await openExpertShards(dir)).key).toBe(s.key)
  await expect(shard({ model: join(root, 'ckpt'), out: join(root, 'cli-bad'), experts: true, stages: '2' })).rejects.toThrow(/--experts/)
}, 60_000)

it('signs a receipt part per request from the rows it was sent (request spans), when the stage finishes it', async () => {
  const D = layout.shape.hiddenSize
  const [l0, l1] = layout.shape.moe!.moeLayers as [number, number]
  const key = makeSigner()
  const holder = createExpertHolder({ dir, layout, model: MODEL, modelId: 'moe', experts: [], maxExperts: 8, signer: key })
  await holder.start()
  const bytes = (parts: Uint8Array[]): Uint8Array => Uint8Array.from(parts.flatMap(p => [...p]))
  const f32 = (a: Float32Array): Buffer => Buffer.from(a.buffer, a.byteOffset, a.byteLength)
  try {
    // Step 0: rows 0-1 of request A, row 2 of B; expert 3 takes rows 0 and 2, expert 1 row 1.
    const data0 = Float32Array.from({ length: 3 * D }, (_, i) => Math.sin(i))
    const a0 = decodePayload(await holder.handle(bytes(encodePayloadParts({
      kind: 'compute', model: MODEL, step: 0, layer: l0, rows: 3, width: D,
      groups: [{ expert: 1, rows: [1], weights: [1] }, { expert: 3, rows: [0, 2], weights: [0.5, 0.75] }],
      spans: [{ id: 'req-A', rows: 2 }, { id: 'req-B', rows: 1 }], data: data0,
    }))))
    // Step 1, the next layer: one row of A, expert 6.
    const data1 = Float32Array.from({ length: D }, (_, i) => Math.cos(i))
    const a1 = decodePayload(await holder.handle(bytes(encodePayloadParts({
      kind: 'compute', model: MODEL, step: 1, layer: l1, rows: 1, width: D,
      groups: [{ expert: 6, rows: [0], weights: [1] }], spans: [{ id: 'req-A', rows: 1 }], data: data1,
    }))))
    if (a0.kind !== 'partial' || a1.kind !== 'partial') throw new Error('no partials')
    expect(holder.openRequests()).toBe(2)

    const finish = async (requestId: string, sign: boolean, step: number): Promise<SignedReceiptPart | undefined> => {
      const f = decodePayload(await holder.handle(bytes(encodePayloadParts({ kind: 'finish', model: MODEL, step, requestId, sign }))))
      if (f.kind !== 'part' || f.step !== step) throw new Error(`answer ${f.kind}`)
      return f.part as SignedReceiptPart | undefined
    }
    const part = (await finish('req-A', true, 2))!
    expect(verifyReceiptPart(part, key.publicKey)).toBe(true)
    const sha = (...chunks: Buffer[]): string => { const h = createHash('sha256'); for (const c of chunks) h.update(c); return h.digest('hex') }
    expect(part.body).toMatchObject({
      requestId: 'req-A', peerId: key.peerId, model: 'moe', layers: [l0, l1],
      // A's rows as received and A's partial sums as returned, raw f32, in arrival order.
      inputHash: sha(f32(data0.subarray(0, 2 * D)), f32(data1)),
      outputHash: sha(f32(a0.data.subarray(0, 2 * D)), f32(a1.data)),
      tokens: { input: 3, output: 3 },
      experts: [{ layer: l0, experts: [1, 3] }, { layer: l1, experts: [6] }],
    })
    // Finished is forgotten: a second finish signs nothing.
    expect(await finish('req-A', true, 3)).toBeUndefined()
    // B's part covers only B's row and the one expert that ran it.
    const b = (await finish('req-B', true, 4))!
    expect(b.body).toMatchObject({ layers: [l0, l0], tokens: { input: 1, output: 1 }, experts: [{ layer: l0, experts: [3] }], inputHash: sha(f32(data0.subarray(2 * D))) })
    expect(holder.openRequests()).toBe(0)
    // A tampered part (a different share of the work) does not verify under the holder's key.
    expect(verifyReceiptPart({ ...part, body: { ...part.body, tokens: { input: 30, output: 30 } } }, key.publicKey)).toBe(false)
    // sign: false (a failed request): forgotten, nothing signed; rows without spans are attributed to nobody.
    await holder.handle(bytes(encodePayloadParts({ kind: 'compute', model: MODEL, step: 5, layer: l0, rows: 1, width: D, groups: [{ expert: 1, rows: [0], weights: [1] }], spans: [{ id: 'req-C', rows: 1 }], data: data1 })))
    await holder.handle(frame(l0, 1, D, 6))
    expect(holder.openRequests()).toBe(1)
    expect(await finish('req-C', false, 7)).toBeUndefined()
    expect(holder.openRequests()).toBe(0)
  } finally {
    await holder.stop()
  }
}, 60_000)
