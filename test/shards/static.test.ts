/**
 * Static shards (`--static CTX[,CHUNK]`): the fixed-shape graphs, run with onnxruntime, pick the
 * same greedy tokens as the dynamic graphs of the same compile — unsplit and every 2- and 3-stage
 * split, a prompt several chunks long (the last chunk padded), decoding until the KV buffer is
 * full (the last chunk that no longer fits runs position by position) — and every shape in them
 * is a number.
 */
import { mkdtemp, readFile, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import onnxProto from 'onnx-proto'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { compileShards, generateTestModel, loadManifest, validateManifest, verifyShardFiles } from '../../shards/index.ts'
import { main } from '../../scripts/cli.ts'
import { allSplits, encodePrompt, greedyDecode, openPipeline } from './pipeline.ts'
import { openStaticPipeline, staticGreedy } from './static-pipeline.ts'

const PROMPT = 'The quick brown fox jumps over the lazy dog. Once upon a time there was a mesh of small machines'
const CHUNK = 8
const N = 24

let root: string
beforeAll(async () => { root = await mkdtemp(join(tmpdir(), 'shoal-static-')) })
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

const maxAbsDiff = (a: Float32Array, b: Float32Array): number => {
  let m = 0
  for (let i = 0; i < a.length; i++) m = Math.max(m, Math.abs(a[i]! - b[i]!))
  return m
}

describe.each(['llama', 'qwen3'] as const)('%s static graphs', (arch) => {
  let modelDir: string
  let prompt: number[]
  let dynamic: { tokens: number[], logits: Float32Array[] }
  let ctx: number

  beforeAll(async () => {
    modelDir = join(root, arch)
    await generateTestModel({ architecture: arch, outDir: modelDir, seed: 4 })
    prompt = await encodePrompt(modelDir, PROMPT)
    // The buffer holds exactly the prompt and every fed-back token: the run ends with it full.
    ctx = prompt.length + N - 1
  })

  it('unsplit: fixed shapes, same greedy tokens as the dynamic graphs, logits within float rounding', async () => {
    expect(prompt.length).toBeGreaterThan(2 * CHUNK)
    const out = join(root, `${arch}-1`)
    const manifest = await compileShards({ modelDir, outDir: out, static: { contextLength: ctx, chunk: CHUNK } })
    expect(manifest.static).toEqual({ contextLength: ctx, chunk: CHUNK, opSet: 'standard' })
    expect(manifest.stages[0]!.static).toEqual({ prefill: 'stage-0/static-prefill.onnx', decode: 'stage-0/static-decode.onnx' })
    // The manifest round-trips through validation and lists (and hashes) the static files.
    expect((await loadManifest(out)).static).toEqual(manifest.static)
    await verifyShardFiles(out, manifest)
    expect(manifest.stages[0]!.files.map(f => f.path)).toContain('stage-0/static.onnx.data')

    for (const [file, s] of [['static-prefill.onnx', CHUNK], ['static-decode.onnx', 1]] as const) {
      const model = onnxProto.onnx.ModelProto.decode(await readFile(join(out, 'stage-0', file)))
      for (const io of [...model.graph!.input!, ...model.graph!.output!]) {
        const dims = io.type!.tensorType!.shape!.dim!
        expect(dims.every(d => d.dimParam === '' || d.dimParam == null), `${file} ${io.name}`).toBe(true)
        if (io.name === 'input_ids') expect(dims.map(d => Number(d.dimValue))).toEqual([1, s])
        if (io.name === 'present.0.key') expect(dims.map(d => Number(d.dimValue))).toEqual([1, manifest.shape.numKvHeads, ctx, manifest.shape.headDim])
      }
      // NPU compilers read standard ONNX only.
      expect(model.graph!.node!.every(n => n.domain === '' || n.domain == null), file).toBe(true)
      expect(model.graph!.node!.some(n => n.opType === 'Concat' && n.name!.includes('cache'))).toBe(false)
    }

    const dyn = await openPipeline(out, manifest)
    try { dynamic = await greedyDecode(dyn, prompt, N) } finally { await dyn.release() }
    const st = await openStaticPipeline(out, manifest)
    try {
      const r = await staticGreedy(st, prompt, N)
      const err = Math.max(...r.logits.map((l, i) => maxAbsDiff(l, dynamic.logits[i]!)))
      console.log(`${arch}: prompt ${prompt.length} tokens, chunk ${CHUNK}, ctx ${ctx}, max |static − dynamic logit| ${err.toExponential(2)}, distinct tokens ${new Set(r.tokens).size}`)
      expect(r.tokens).toEqual(dynamic.tokens)
      expect(new Set(r.tokens).size).toBeGreaterThanOrEqual(6)
      expect(err).toBeLessThan(1e-3)
    } finally {
      await st.release()
    }
  })

  it('every 2- and 3-stage split: same greedy tokens', async () => {
    for (const layers of [...allSplits(4, 2), ...allSplits(4, 3)]) {
      const out = join(root, `${arch}-${layers.map(([a, b]) => `${a}_${b}`).join('-')}`)
      const manifest = await compileShards({ modelDir, outDir: out, layers, static: { contextLength: ctx, chunk: CHUNK } })
      const st = await openStaticPipeline(out, manifest)
      try {
        const r = await staticGreedy(st, prompt, N)
        expect(r.tokens, `split ${JSON.stringify(layers)}`).toEqual(dynamic.tokens)
      } finally {
        await st.release()
      }
      await rm(out, { recursive: true, force: true })
    }
  })
})

describe('int4 static graphs with f32 activations', () => {
  it('pick the dynamic graphs\' greedy tokens (int8 activations may not: shards/DESIGN.md)', async () => {
    const modelDir = join(root, 'int4')
    await generateTestModel({ architecture: 'llama', outDir: modelDir, seed: 4 })
    const prompt = await encodePrompt(modelDir, PROMPT)
    const out = join(root, 'int4-shard')
    const manifest = await compileShards({ modelDir, outDir: out, quant: 'int4', accuracyLevel: 0, static: { contextLength: prompt.length + N - 1, chunk: CHUNK } })
    const dyn = await openPipeline(out, manifest)
    let want: number[]
    try { want = (await greedyDecode(dyn, prompt, N)).tokens } finally { await dyn.release() }
    const st = await openStaticPipeline(out, manifest)
    try {
      expect((await staticGreedy(st, prompt, N)).tokens).toEqual(want)
    } finally {
      await st.release()
    }
  })
})

describe('--static shapes', () => {
  it('refuses a context beyond the model, a chunk beyond the context', async () => {
    const modelDir = join(root, 'shapes')
    await generateTestModel({ architecture: 'llama', outDir: modelDir })
    await expect(compileShards({ modelDir, outDir: join(root, 'shapes-a'), static: { contextLength: 1 << 30 } })).rejects.toThrow(/exceeds the model's context limit/)
    await expect(compileShards({ modelDir, outDir: join(root, 'shapes-b'), static: { contextLength: 64, chunk: 65 } })).rejects.toThrow(/chunk must be an integer in 1\.\.64/)
  })

  it('a manifest with bad static fields is refused; one without them (older compilers) loads', async () => {
    const modelDir = join(root, 'shapes')
    const m = await compileShards({ modelDir, outDir: join(root, 'shapes-c'), static: { contextLength: 32, chunk: 4 } })
    const copy = (): any => JSON.parse(JSON.stringify(m))
    const bad1 = copy(); bad1.static.chunk = 33
    expect(() => validateManifest(bad1)).toThrow(/static.chunk/)
    const bad2 = copy(); bad2.stages[0].files = bad2.stages[0].files.filter((f: { path: string }) => !f.path.endsWith('static-decode.onnx'))
    expect(() => validateManifest(bad2)).toThrow(/static graph/)
    const bad3 = copy(); delete bad3.static
    expect(() => validateManifest(bad3)).toThrow(/without a top-level static/)
    const old = copy(); delete old.static; delete old.stages[0].static
    expect(validateManifest(old).static).toBeUndefined()
  })

  it('shoal shard --static CTX,CHUNK writes them; a malformed value exits 2', async () => {
    const modelDir = join(root, 'shapes')
    const out = join(root, 'shapes-cli')
    const writes: string[] = []
    const orig = process.stderr.write.bind(process.stderr)
    process.stderr.write = ((s: string) => { writes.push(String(s)); return true }) as typeof process.stderr.write
    try {
      expect(await main(['shard', '--model', modelDir, '--out', out, '--stages', '2', '--static', '40,8'])).toBe(0)
      expect(await main(['shard', '--model', modelDir, '--out', join(root, 'shapes-cli2'), '--static', '40x'])).toBe(2)
    } finally {
      process.stderr.write = orig
    }
    expect(writes.join('')).toMatch(/--static must be CTX or CTX,CHUNK/)
    const m = await loadManifest(out)
    expect(m.static).toEqual({ contextLength: 40, chunk: 8, opSet: 'standard' })
    expect(m.stages.map(s => s.static?.decode)).toEqual(['stage-0/static-decode.onnx', 'stage-1/static-decode.onnx'])
  })
})
