/**
 * `shoal shard --experts` writes what a stage node serves (tokenizer, model id, the checkpoint's
 * hash in the layout, so the layout's hash is the key). A holder that loads experts on first use (what a daemon's holder does): within its budget it
 * keeps what frames name; past it, it releases the least recently used expert, so a stage that
 * re-planned (and now sends it another share) is served instead of refused. Answers equal a
 * holder that had the experts loaded from the start.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, expect, it } from 'vitest'
import { createExpertHolder, decodePayload, encodePayloadParts, openExpertShards } from '../../daemon/experts/index.ts'
import { shard } from '../../scripts/commands/shard.ts'
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
