/**
 * The papers' long-context rope families: LongRoPE (Phi-3.5-mini, the Cascadia NPU model) and
 * YaRN (Qwen2.5 long-context, DeepSeek-style). Generated checkpoints carry each block with
 * original_max_position_embeddings = 32 of 2048, so a whole greedy sequence runs on both sides of
 * it (LongRoPE's long factors apply from position 32 on; YaRN is position-independent but its
 * ramp and mscale must match). The compiled graphs — both op tables, one stage and a 2-stage
 * split, and the static graphs — pick the same tokens as the independent float64 reference, with
 * prompts that end before and after the switch and a prefill that straddles it.
 */
import { readFileSync } from 'node:fs'
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { compileShards, generateTestModel, normalizeConfig, type TestArchitecture } from '../../shards/index.ts'
import { ReferenceModel } from '../support/reference.ts'
import { greedyDecode, openPipeline } from './pipeline.ts'
import { openStaticPipeline, staticGreedy } from './static-pipeline.ts'

const ORIGINAL = 32
const N = 48

let root: string
beforeAll(async () => { root = await mkdtemp(join(tmpdir(), 'shoal-long-rope-')) })
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

const cases: Array<[string, TestArchitecture, 'longrope' | 'yarn']> = [
  ['phi3 longrope', 'phi3', 'longrope'],
  ['qwen2 yarn', 'qwen2', 'yarn'],
]

describe.each(cases)('%s', (name, architecture, rope) => {
  let modelDir: string
  const ref = new Map<string, number[]>()
  // Short: 7 tokens, the switch happens while decoding. Long: 40 tokens, the prefill straddles it.
  const prompts = {
    short: [1, 2, 3, 40, 50, 60, 70],
    long: Array.from({ length: 40 }, (_, i) => 3 + (i * 37) % 500),
  }

  beforeAll(async () => {
    modelDir = join(root, name.replace(' ', '-'))
    await generateTestModel({ architecture, outDir: modelDir, seed: 4, longContext: { rope, originalMaxPositions: ORIGINAL } })
    const model = new ReferenceModel(modelDir)
    for (const [k, p] of Object.entries(prompts)) {
      const r = model.greedy(p, N)
      // A sequence stuck on one token would prove little about positions.
      expect(new Set(r.tokens).size).toBeGreaterThanOrEqual(6)
      ref.set(k, r.tokens)
    }
  })

  it('the compiled rotary has the scaling in it', () => {
    const spec = normalizeConfig(JSON.parse(readFileSync(join(modelDir, 'config.json'), 'utf8')) as Record<string, unknown>)
    expect(spec.rotary.scale).toBeGreaterThan(1)
    if (rope === 'longrope') expect(spec.rotary.long?.from).toBe(ORIGINAL)
    else expect(spec.rotary.long).toBeUndefined()
  })

  for (const opSet of ['standard', 'ort-contrib'] as const) {
    it(`${opSet}: one stage and a 2-stage split match the float64 reference token for token`, async () => {
      for (const layers of [undefined, [[0, 1], [2, 3]] as Array<[number, number]>]) {
        const out = join(root, `${name.replace(' ', '-')}-${opSet}-${layers === undefined ? 1 : 2}`)
        const manifest = await compileShards({ modelDir, outDir: out, opSet, ...(layers !== undefined ? { layers } : {}) })
        const p = await openPipeline(out, manifest)
        try {
          for (const [k, prompt] of Object.entries(prompts)) {
            expect((await greedyDecode(p, prompt, N)).tokens, `${k} prompt, ${manifest.stages.length} stage(s)`).toEqual(ref.get(k))
          }
        } finally {
          await p.release()
        }
        await rm(out, { recursive: true, force: true })
      }
    })
  }

  it('static graphs (CHUNK 12: the long prompt’s third chunk straddles the switch) match the reference too', async () => {
    const out = join(root, `${name.replace(' ', '-')}-static`)
    const manifest = await compileShards({ modelDir, outDir: out, layers: [[0, 1], [2, 3]], static: { contextLength: 40 + N, chunk: 12 } })
    const p = await openStaticPipeline(out, manifest)
    try {
      for (const [k, prompt] of Object.entries(prompts)) {
        expect((await staticGreedy(p, prompt, N)).tokens, `${k} prompt`).toEqual(ref.get(k))
      }
    } finally {
      await p.release()
    }
  })
})
