/**
 * Manifest integrity and stage planning: hashes verify, tampering and truncation are detected,
 * malformed manifests and bad --layers are typed errors; the CLI writes a shard directory;
 * the compile cache and demo model are built once and reused.
 */
import { mkdtemp, readFile, rm, stat, writeFile, appendFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import {
  compileCached, compileShards, ensureDemoModel, generateTestModel, isShardDir, loadManifest,
  parseLayerRanges, planStages, verifyShardFiles, validateManifest,
} from '../../shards/index.ts'
import { decodeAttentionForm } from '../../daemon/engine/index.ts'
import { main } from '../../scripts/cli.ts'

let root: string
let modelDir: string
beforeAll(async () => {
  root = await mkdtemp(join(tmpdir(), 'shoal-manifest-'))
  modelDir = join(root, 'llama')
  await generateTestModel({ architecture: 'llama', outDir: modelDir })
})
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

describe('manifest', () => {
  it('records layer ranges and sha256 of every file, and verifies', async () => {
    const out = join(root, 'two')
    const m = await compileShards({ modelDir, outDir: out, stages: 2 })
    expect(m.stages.map(s => [s.layers, s.hasEmbedding, s.hasHead])).toEqual([[[0, 1], true, false], [[2, 3], false, true]])
    expect(m.stages[0]!.files.map(f => f.path)).toEqual(['stage-0/model.onnx', 'stage-0/model.onnx.data', 'stage-0/decode.onnx'])
    const loaded = await loadManifest(out)
    expect(loaded).toEqual(m)
    await verifyShardFiles(out, loaded)
  })

  it('detects a flipped byte and a truncated file', async () => {
    const out = join(root, 'tamper')
    const m = await compileShards({ modelDir, outDir: out, stages: 2 })
    const data = join(out, 'stage-1', 'model.onnx.data')
    const bytes = await readFile(data)
    const mid = bytes.length >> 1
    bytes[mid] = bytes[mid]! ^ 1
    await writeFile(data, bytes)
    await expect(verifyShardFiles(out, m)).rejects.toMatchObject({ code: 'SHOAL_ERR_SHARD_INTEGRITY', path: 'stage-1/model.onnx.data' })
    await verifyShardFiles(out, m, [0]) // stage 0 alone is intact
    await appendFile(join(out, 'tokenizer.json'), ' ')
    await expect(verifyShardFiles(out, m, [0])).rejects.toMatchObject({ code: 'SHOAL_ERR_SHARD_INTEGRITY', message: expect.stringContaining('size') })
  })

  it('rejects malformed manifests with a typed error', async () => {
    const out = join(root, 'bad')
    const m = await compileShards({ modelDir, outDir: out, stages: 2 })
    const bad = [
      { ...m, format: 'shoal-shards/0' },
      { ...m, stages: [m.stages[1]!] },
      { ...m, stages: [{ ...m.stages[0]!, layers: [0, 2] }, m.stages[1]!] },
      { ...m, stages: [m.stages[0]!, { ...m.stages[1]!, files: [{ path: '../x', sha256: 'a'.repeat(64), bytes: 1 }] }] },
      { ...m, quantization: { kind: 'int3' } },
      { ...m, quantization: { kind: 'int8', blockSize: 32, embedding: 'int4' } },
      { ...m, quantization: { kind: 'int4', blockSize: 32, embedding: 'int2' } },
      { ...m, decodeAttention: 'sideways' },
      // The benchmark's int4 kernel: only in int4 shards of block 32 with int8 activations.
      { ...m, quantization: { kind: 'int4', blockSize: 32, kernel: 'fast' } },
      { ...m, quantization: { kind: 'int8', blockSize: 32, kernel: 'native' } },
      { ...m, quantization: { kind: 'int4', blockSize: 128, kernel: 'native' } },
      { ...m, quantization: { kind: 'int4', blockSize: 32, activations: 'f32', kernel: 'native' } },
    ]
    for (const b of bad) expect(() => validateManifest(b)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_MANIFEST' }))
    expect(validateManifest({ ...m, quantization: { kind: 'int4', blockSize: 32, activations: 'int8', kernel: 'native' } }).quantization).toMatchObject({ kernel: 'native' })
    // Manifests before compiler 12 have no decodeAttention (per-head); they still load.
    const { decodeAttention: _, ...before12 } = m
    expect(validateManifest(before12)).not.toHaveProperty('decodeAttention')
    // Manifests before compiler 5 have no quantization.embedding (f32); they still load.
    expect(validateManifest({ ...m, quantization: { kind: 'int4', blockSize: 32, activations: 'int8' } }).quantization).not.toHaveProperty('embedding')
    await writeFile(join(out, 'manifest.json'), '{nope')
    await expect(loadManifest(out)).rejects.toMatchObject({ code: 'SHOAL_ERR_MANIFEST' })
    await expect(loadManifest(join(root, 'missing'))).rejects.toMatchObject({ code: 'SHOAL_ERR_MANIFEST' })
  })
})

describe('stage planning', () => {
  it('splits evenly, earlier stages taking the remainder', () => {
    expect(planStages(4, {})).toEqual([[0, 3]])
    expect(planStages(10, { stages: 3 })).toEqual([[0, 3], [4, 6], [7, 9]])
    expect(planStages(4, { stages: 4 })).toEqual([[0, 0], [1, 1], [2, 2], [3, 3]])
    expect(parseLayerRanges('0-1, 2-2,3')).toEqual([[0, 1], [2, 2], [3, 3]])
  })

  it('rejects ranges that do not cover every layer exactly once', async () => {
    const cases: Array<Array<[number, number]>> = [[[0, 1]], [[0, 1], [3, 3]], [[0, 2], [2, 3]], [[0, 3], [4, 4]], [[1, 3]], [[0, 3], [3, 3]]]
    for (const layers of cases) expect(() => planStages(4, { layers })).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_LAYER_SPLIT', name: 'LayerSplitError' }))
    expect(() => planStages(4, { stages: 5 })).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_LAYER_SPLIT' }))
    expect(() => parseLayerRanges('0-a')).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_LAYER_SPLIT' }))
    await expect(compileShards({ modelDir, outDir: join(root, 'gap'), layers: [[0, 1], [3, 3]] })).rejects.toMatchObject({ code: 'SHOAL_ERR_LAYER_SPLIT' })
  })
})

describe('shoal shard (CLI)', () => {
  it('writes a shard directory and exits 0; a bad split exits 2 with the reason', async () => {
    const out = join(root, 'cli')
    expect(await main(['shard', '--model', modelDir, '--out', out, '--layers', '0-0,1-3', '--quant', 'int4'])).toBe(0)
    const m = await loadManifest(out)
    expect(m.stages.map(s => s.layers)).toEqual([[0, 0], [1, 3]])
    expect(m.quantization).toEqual({ kind: 'int4', blockSize: 32, activations: 'int8', embedding: 'int4' })
    // The one-position attention's form is the one this CPU's probe timed faster (kernel-probe.ts).
    expect(m.decodeAttention).toBe((await decodeAttentionForm(m.shape)).form)
    await verifyShardFiles(out, m)
    const errs: string[] = []
    const orig = process.stderr.write.bind(process.stderr)
    process.stderr.write = ((s: string) => { errs.push(String(s)); return true }) as typeof process.stderr.write
    try {
      expect(await main(['shard', '--model', modelDir, '--out', join(root, 'cli2'), '--layers', '0-1,3-3'])).toBe(2)
      expect(await main(['shard', '--model', join(root, 'nope'), '--out', join(root, 'cli3')])).toBe(2)
      expect(await main(['shard', '--model', modelDir, '--out', join(root, 'cli4'), '--f32-activations'])).toBe(2)
      expect(await main(['shard', '--model', modelDir, '--out', join(root, 'cli6'), '--quant', 'int8', '--f32-embedding'])).toBe(2)
    } finally {
      process.stderr.write = orig
    }
    expect(errs.join('')).toMatch(/layers 2-2 are not covered/)
    expect(errs.join('')).toMatch(/--f32-activations needs --quant int8 or int4/)
    expect(errs.join('')).toMatch(/--f32-embedding needs --quant int4/)
    // Opting into f32 activations is written into the manifest (the engine then batches any mix of context lengths).
    expect(await main(['shard', '--model', modelDir, '--out', join(root, 'cli5'), '--quant', 'int4', '--f32-activations'])).toBe(0)
    expect((await loadManifest(join(root, 'cli5'))).quantization).toEqual({ kind: 'int4', blockSize: 32, activations: 'f32', embedding: 'int4' })
    // A failed attention probe costs speed, not the compile: per-head, and the last line says why.
    // (A head shape this process has not probed: the probe's answers are memoized by shape.)
    const small = join(root, 'small')
    await generateTestModel({ architecture: 'llama', size: 'small', outDir: small })
    const tmp = process.env.TMPDIR
    const out8: string[] = []
    const origOut = process.stdout.write.bind(process.stdout)
    process.env.TMPDIR = join(small, 'config.json') // a file: no temporary directory can be made in it
    process.stdout.write = ((s: string) => { out8.push(String(s)); return true }) as typeof process.stdout.write
    try {
      expect(await main(['shard', '--model', small, '--out', join(root, 'cli8')])).toBe(0)
    } finally {
      process.stdout.write = origOut
      if (tmp === undefined) delete process.env.TMPDIR
      else process.env.TMPDIR = tmp
    }
    expect((await loadManifest(join(root, 'cli8'))).decodeAttention).toBe('per-head')
    expect(out8.join('')).toMatch(/per-head one-position attention \(the probe failed: /)
    // --f32-embedding keeps the token embedding f32, and says so.
    expect(await main(['shard', '--model', modelDir, '--out', join(root, 'cli7'), '--quant', 'int4', '--f32-embedding'])).toBe(0)
    expect((await loadManifest(join(root, 'cli7'))).quantization).toEqual({ kind: 'int4', blockSize: 32, activations: 'int8', embedding: 'f32' })
  })
})

describe('caches', () => {
  it('compileCached compiles once per checkpoint content and reuses the result', async () => {
    const cache = join(root, 'cache')
    const a = await compileCached(modelDir, cache)
    expect(isShardDir(a)).toBe(true)
    expect(isShardDir(modelDir)).toBe(false)
    const m = await loadManifest(a)
    expect(a.endsWith(m.sourceHash)).toBe(true)
    expect(m.stages).toHaveLength(1)
    // A cache compile is per-head: the same checkpoint compiles to the same manifest on every CPU.
    expect(m.decodeAttention).toBe('per-head')
    const before = (await stat(join(a, 'manifest.json'))).mtimeMs
    expect(await compileCached(modelDir, cache)).toBe(a)
    expect((await stat(join(a, 'manifest.json'))).mtimeMs).toBe(before)
  })

  it("decodeAttention: a form for 'standard' graphs is refused; a chooser is not asked", async () => {
    await expect(compileShards({ modelDir, outDir: join(root, 'std-grouped'), opSet: 'standard', decodeAttention: 'grouped' }))
      .rejects.toMatchObject({ code: 'SHOAL_ERR_CHECKPOINT' })
    let asked = 0
    const m = await compileShards({ modelDir, outDir: join(root, 'std-chooser'), opSet: 'standard', decodeAttention: async () => { asked++; return 'grouped' } })
    expect(asked).toBe(0)
    expect(m).not.toHaveProperty('decodeAttention')
  })

  it('ensureDemoModel generates once, atomically, labelled as random weights', async () => {
    const cache = join(root, 'demo-cache')
    const [a, b] = await Promise.all([ensureDemoModel(cache, { size: 'tiny' }), ensureDemoModel(cache, { size: 'tiny' })])
    expect(a).toBe(b)
    expect(await ensureDemoModel(cache, { size: 'tiny' })).toBe(a)
    const m = await loadManifest(await compileCached(a, cache))
    expect(m.modelId).toBe('shoal-demo')
    expect(m.description).toMatch(/random weights/)
  })
})
