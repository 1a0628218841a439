/**
 * The 'ort-contrib' op table (SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization,
 * com.microsoft RotaryEmbedding + GroupQueryAttention) is exact: for every architecture its fp32
 * graphs — one stage and every 2- and 3-stage split — produce the same 64 greedy tokens as the
 * float64 reference, every split is bit-identical to its unsplit graph, and its logits stay within
 * float rounding of the 'standard' graphs, also for chunked prefill; right-padded batches of any
 * mix of lengths decode bit-identically to each row alone (per-row attention lengths). Both forms
 * of the one-position attention (DecodeAttentionForm: per-head, the default, and grouped) keep
 * the reference's tokens and batched decode's bits (the benchmark's third form, 'native':
 * native-attention.test.ts). One
 * documented limit: a step with batch > 1, S > 1 and a non-empty past is rejected by
 * onnxruntime (manifest.batchedPrefillWithPast = false).
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { compileShards, generateTestModel, TEST_ARCHITECTURES, type ShardManifest, type TestArchitecture } from '../../shards/index.ts'
import { ReferenceModel } from '../support/reference.ts'
import { allSplits, batchedAgainstAlone, emptyPast, encodePrompt, greedyDecode, maxDiff, raggedRows, sameBytes, stepRows as step, TEST_PROMPT, withPipeline } from './pipeline.ts'

const N = 64

let root: string
beforeAll(async () => { root = await mkdtemp(join(tmpdir(), 'shoal-contrib-')) })
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

const promptIds = async (dir: string): Promise<number[]> => await encodePrompt(dir, TEST_PROMPT)



describe.each(TEST_ARCHITECTURES)('%s tiny fp32, ort-contrib', (arch: TestArchitecture) => {
  let modelDir: string
  let prompt: number[]
  let ref: { tokens: number[], margins: number[], logits: Float64Array[] }
  let standardDir: string
  let standard: ShardManifest
  let contribDir: string
  let contrib: ShardManifest
  let unsplit: Float32Array[]
  let groupedDir: string
  let grouped: ShardManifest

  beforeAll(async () => {
    modelDir = join(root, arch)
    await generateTestModel({ architecture: arch, outDir: modelDir, seed: 4 })
    prompt = await promptIds(modelDir)
    ref = new ReferenceModel(modelDir).greedy(prompt, N)
    standardDir = join(root, `${arch}-standard`)
    standard = await compileShards({ modelDir, outDir: standardDir, opSet: 'standard' })
    contribDir = join(root, `${arch}-contrib`)
    contrib = await compileShards({ modelDir, outDir: contribDir, opSet: 'ort-contrib' })
    groupedDir = join(root, `${arch}-grouped`)
    grouped = await compileShards({ modelDir, outDir: groupedDir, opSet: 'ort-contrib', decodeAttention: 'grouped' })
  })

  it('one stage matches the float64 reference token for token', async () => {
    expect(contrib.opSet).toBe('ort-contrib')
    expect(contrib.batchPadding).toBe('right')
    expect(contrib.batchedPrefillWithPast).toBe(false)
    expect(contrib.decodeAttention).toBe('per-head')
    expect(standard.batchPadding).toBe('left')
    expect(standard.batchedPrefillWithPast).toBe(true)
    const r = await withPipeline(contribDir, contrib, async p => await greedyDecode(p, prompt, N))
    const s = await withPipeline(standardDir, standard, async p => await greedyDecode(p, prompt, N))
    const vsRef = Math.max(...r.logits.map((l, i) => maxDiff(l, ref.logits[i]!)))
    const vsStandard = Math.max(...r.logits.map((l, i) => maxDiff(l, s.logits[i]!)))
    console.log(`${arch} ort-contrib: max |logit − reference| ${vsRef.toExponential(2)}, max |logit − standard| ${vsStandard.toExponential(2)}, min reference top-2 margin ${Math.min(...ref.margins).toExponential(2)}`)
    expect(r.tokens).toEqual(ref.tokens)
    expect(new Set(r.tokens).size).toBeGreaterThanOrEqual(8)
    expect(vsRef).toBeLessThan(1e-3)
    expect(vsStandard).toBeLessThan(1e-3)
    unsplit = r.logits
  })

  it('every 2- and 3-stage split matches the reference and is bit-identical to one stage', async () => {
    for (const layers of [...allSplits(4, 2), ...allSplits(4, 3)]) {
      const out = join(root, `${arch}-contrib-${layers.map(([a, b]) => `${a}_${b}`).join('-')}`)
      const m = await compileShards({ modelDir, outDir: out, layers, opSet: 'ort-contrib' })
      const r = await withPipeline(out, m, async p => await greedyDecode(p, prompt, N))
      expect(r.tokens, `split ${JSON.stringify(layers)}`).toEqual(ref.tokens)
      r.logits.forEach((l, i) => expect(sameBytes(l, unsplit[i]!), `split ${JSON.stringify(layers)} step ${i}`).toBe(true))
      await rm(out, { recursive: true, force: true })
    }
  })

  it('the grouped one-position attention matches the reference token for token, within rounding of per-head', async () => {
    expect(grouped.decodeAttention).toBe('grouped')
    const r = await withPipeline(groupedDir, grouped, async p => await greedyDecode(p, prompt, N))
    expect(r.tokens).toEqual(ref.tokens)
    expect(Math.max(...r.logits.map((l, i) => maxDiff(l, unsplit[i]!)))).toBeLessThan(1e-4)
  })

  it.each(['per-head', 'grouped'] as const)('right-padded batches of any mix of lengths: batched decode is bit-identical to each row alone (%s)', async (form) => {
    const [dir, manifest] = form === 'grouped' ? [groupedDir, grouped] : [contribDir, contrib]
    const rows = raggedRows(prompt)
    // The grouped form's packed products need no width of a multiple of 16, so it gets an odd one.
    const mismatches = await withPipeline(dir, manifest, async p => await batchedAgainstAlone(p, rows, 4, form === 'grouped' ? 19 : 16))
    expect(mismatches).toEqual([])
  })

  it('chunked prefill (batch 1, S > 1 after a past) agrees with the standard graph', async () => {
    const run = async (dir: string, m: ShardManifest): Promise<Float32Array> => await withPipeline(dir, m, async p => {
      const a = prompt.slice(0, 6)
      const b = prompt.slice(6)
      const first = await step(p, [a], [a.map((_, j) => j)], [a.map(() => 1)], emptyPast(m, 1))
      return (await step(p, [b], [b.map((_, j) => 6 + j)], [prompt.map(() => 1)], first.present)).logits
    })
    expect(maxDiff(await run(contribDir, contrib), await run(standardDir, standard))).toBeLessThan(1e-3)
  })

  it('a batched step with S > 1 after a past is refused by onnxruntime (the documented limit)', async () => {
    await withPipeline(contribDir, contrib, async p => {
      const first = await step(p, [[5, 6], [7, 8]], [[0, 1], [0, 1]], [[1, 1], [1, 1]], emptyPast(contrib, 2))
      await expect(step(p, [[9, 10], [11, 12]], [[2, 3], [2, 3]], [[1, 1, 1, 1], [1, 1, 1, 1]], first.present)).rejects.toThrow()
    })
  })
})

describe('ort-contrib with rope scaling', () => {
  it('llama3-scaled rope (cos/sin caches computed at compile time) matches the reference', async () => {
    const dir = join(root, 'llama3-rope')
    await generateTestModel({ architecture: 'llama', seed: 5, outDir: dir, ropeScaling: { rope_type: 'llama3', factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 64 } })
    const prompt = [1, 2, 3, 40, 50, 60, 70]
    const ref = new ReferenceModel(dir).greedy(prompt, N)
    const m = await compileShards({ modelDir: dir, outDir: `${dir}-shards`, stages: 2, opSet: 'ort-contrib' })
    expect((await withPipeline(`${dir}-shards`, m, async p => await greedyDecode(p, prompt, N))).tokens).toEqual(ref.tokens)
  })
})
