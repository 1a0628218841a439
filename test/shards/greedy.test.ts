/**
 * Whole-sequence greedy identity: for every architecture, the compiled fp32 stage graphs (one
 * stage, and every 2- and 3-stage split, chained through real onnxruntime sessions with a KV
 * cache) produce the same 64 tokens as an independent float64 reference, and every split
 * produces logits bit-identical to the unsplit graph.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { compileShards, generateTestModel, TEST_ARCHITECTURES, type TestArchitecture } from '../../shards/index.ts'
import { ReferenceModel } from '../support/reference.ts'
import { allSplits, encodePrompt, greedyDecode, openPipeline } from './pipeline.ts'

const N = 64
const PROMPT = 'The quick brown fox jumps over the lazy dog. Once upon a time'

let root: string
beforeAll(async () => { root = await mkdtemp(join(tmpdir(), 'shoal-greedy-')) })
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

const promptIds = async (dir: string): Promise<number[]> => await encodePrompt(dir, PROMPT)

describe.each(TEST_ARCHITECTURES)('%s tiny fp32', (arch: TestArchitecture) => {
  let modelDir: string
  let prompt: number[]
  let ref: { tokens: number[], margins: number[], logits: Float64Array[] }
  let unsplit: Float32Array[]

  beforeAll(async () => {
    modelDir = join(root, arch)
    await generateTestModel({ architecture: arch, outDir: modelDir, seed: 4 })
    prompt = await promptIds(modelDir)
    ref = new ReferenceModel(modelDir).greedy(prompt, N)
  })

  it('one stage matches the float64 reference token for token', async () => {
    const out = join(root, `${arch}-1`)
    const manifest = await compileShards({ modelDir, outDir: out })
    const p = await openPipeline(out, manifest)
    try {
      const r = await greedyDecode(p, prompt, N)
      let maxErr = 0
      r.logits.forEach((l, i) => l.forEach((v, j) => { maxErr = Math.max(maxErr, Math.abs(v - ref.logits[i]![j]!)) }))
      console.log(`${arch}: min reference top-2 margin ${Math.min(...ref.margins).toExponential(2)}, max |logit − reference| ${maxErr.toExponential(2)}, distinct tokens ${new Set(r.tokens).size}`)
      expect(r.tokens).toEqual(ref.tokens)
      // A sequence that collapsed into one repeated token would prove little.
      expect(new Set(r.tokens).size).toBeGreaterThanOrEqual(8)
      expect(maxErr).toBeLessThan(1e-3)
      unsplit = r.logits
    } finally {
      await p.release()
    }
  })

  it('every 2- and 3-stage split is bit-identical to one stage', async () => {
    const splits = [...allSplits(4, 2), ...allSplits(4, 3)]
    for (const layers of splits) {
      const out = join(root, `${arch}-${layers.map(([a, b]) => `${a}_${b}`).join('-')}`)
      const manifest = await compileShards({ modelDir, outDir: out, layers })
      expect(manifest.stages.map(s => s.layers)).toEqual(layers)
      const p = await openPipeline(out, manifest)
      try {
        const r = await greedyDecode(p, prompt, N)
        expect(r.tokens, `split ${JSON.stringify(layers)}`).toEqual(ref.tokens)
        r.logits.forEach((l, i) => {
          expect(Buffer.from(l.buffer, l.byteOffset, l.byteLength).equals(Buffer.from(unsplit[i]!.buffer, unsplit[i]!.byteOffset, unsplit[i]!.byteLength)), `split ${JSON.stringify(layers)} step ${i}`).toBe(true)
        })
      } finally {
        await p.release()
      }
      await rm(out, { recursive: true, force: true })
    }
  })
})
