/**
 * shoal's kernels as nodes run them (daemon/engine/native): off, with the reason, where they cannot
 * be built; MatMulF32's bits, onnxruntime's MatMul's at any row count; and, where the machine builds the kernels
 * (x86-64 Linux with `cc`), the library built, loaded and self-checked, int4 shards run on it
 * through the engine's workers exactly as shards compiled with MatMulQ4 and DecodeAttention nodes
 * run, batched bit-exactly on every CPU, verify steps giving every position one-position bits
 * (five architectures), and a daemon serving on it by default (a whole model with prompt lookup,
 * a multi-stage one as a local chain with the whole model's tokens, a draft model, experts on
 * holders), saying so in its log, and on onnxruntime's kernels with `kernels: 'onnxruntime'`. The kernels' own arithmetic and their
 * agreement with onnxruntime's ops are test/shards/native-matmul.test.ts's and
 * native-attention.test.ts's; the graph swap itself, pure, is native-swap.test.ts's.
 */
import { execFile } from 'node:child_process'
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { dirname, join } from 'node:path'
import { promisify } from 'node:util'
import ort from 'onnxruntime-node'
import pino from 'pino'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { argmax, createStageEngine, int4KernelApplies, int4ProductsTakeKernel, prepareNativeKernels, stageInfoOf, swapKernels } from '../../daemon/engine/index.ts'
import { createOrtSession } from '../../daemon/engine/backend/onnxruntime.ts'
import type { BatchingStageEngine, StepOutput } from '../../daemon/engine/index.ts'
import { hasCompiler } from '../../daemon/engine/native/build.ts'
import { f32ProductsExact } from '../../daemon/engine/native/f32-check.ts'
import { NATIVE_KERNEL_DOMAIN } from '../../shards/contract.ts'
import type { ShardManifest } from '../../shards/contract.ts'
import { DT, GraphBuilder } from '../../shards/graph/builder.ts'
import { compileExpertShards, compileShards, generateTestModel } from '../../shards/index.ts'
import { greedyDecode } from '../shards/pipeline.ts'
import type { Pipeline } from '../shards/pipeline.ts'
import { linkTo, planFor, stageFor, startHolders } from '../experts/spread-stage.ts'
import { startDaemon } from '../e2e/daemon.ts'
import { greedyAlone, greedyTogether, logitRows, logitsOf, sameBits } from './greedy-batches.ts'

const kernelHere = process.platform === 'linux' && process.arch === 'x64' && await hasCompiler()

const TOKENS = 48

const prompts = [16, 17, 19, 23].map((n, i) => Array.from({ length: n }, (_, j) => 1 + ((i * 131 + j * 37) % 500)))

describe('shoal\'s kernels where they cannot be built', () => {
  it('is off, with the reason, where there is no C compiler', async () => {
    // A process whose PATH has node and nothing else: no `cc`.
    const script = `import { prepareNativeKernels } from ${JSON.stringify(join(import.meta.dirname, '..', '..', 'daemon', 'engine', 'native', 'kernels.ts'))}
console.log(JSON.stringify(await prepareNativeKernels(${JSON.stringify(join(tmpdir(), 'shoal-no-cc'))})))`
    const { stdout } = await promisify(execFile)(process.execPath, ['--input-type=module', '-e', script], { env: { PATH: dirname(process.execPath) } })
    const kernels = JSON.parse(stdout.trim().split('\n').at(-1)!) as { off?: string }
    expect(kernels.off).toMatch(process.platform === 'linux' && process.arch === 'x64' ? /no C compiler/ : /x86-64 Linux only/)
  })
})

describe.skipIf(!kernelHere)('shoal\'s kernels in a node', () => {
  let root: string
  let lib: string
  let manifest: ShardManifest
  let compiled: ShardManifest
  const engines: BatchingStageEngine[] = []

  const engineOf = async (dir: string, m: ShardManifest, kernels?: string): Promise<BatchingStageEngine> => {
    const st = m.stages[0]!
    const e = createStageEngine({
      graphPath: join(dir, ...st.graph.split('/')),
      ...(st.decodeGraph === undefined ? {} : { decodeGraphPath: join(dir, ...st.decodeGraph.split('/')) }),
      stage: stageInfoOf(m),
      threads: 1,
      maxSequences: 8,
      ...(kernels === undefined ? {} : { kernels }),
    })
    engines.push(e)
    await e.start()
    return e
  }

  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-native-kernels-'))
    const kernels = await prepareNativeKernels(join(root, 'kernels'))
    if (!('lib' in kernels)) throw new Error(`the kernel did not build here: ${kernels.off}`)
    lib = kernels.lib
    await generateTestModel({ architecture: 'llama', outDir: join(root, 'ckpt'), size: 'small' })
    manifest = await compileShards({ modelDir: join(root, 'ckpt'), outDir: join(root, 'shard'), quant: 'int4' })
    compiled = await compileShards({ modelDir: join(root, 'ckpt'), outDir: join(root, 'shard-q4'), quant: 'int4', kernel: 'native', decodeAttention: 'native' })
  }, 180_000)
  afterAll(async () => {
    await Promise.all(engines.map(async e => { await e.stop() }))
    if (root !== undefined) await rm(root, { recursive: true, force: true })
  })

  it('builds, loads and passes its self-check; a second preparation is the first', async () => {
    expect(lib).toMatch(/libshoal-kernels\.so$/)
    expect(await prepareNativeKernels(join(root, 'elsewhere'))).toEqual({ lib })
    expect(int4KernelApplies(manifest)).toBe(true)
  })

  it('MatMulF32 gives onnxruntime\'s MatMul\'s bits at any row count and shape (so f32 shards decode the same tokens on it)', async () => {
    expect(await f32ProductsExact(lib)).toBe(true)
    const dir = await mkdtemp(join(tmpdir(), 'shoal-f32-bits-'))
    let s = 11
    const rand = (): number => { s = (Math.imul(s, 1103515245) + 12345) >>> 0; return (s >>> 8) / 16777216 - 0.5 }
    try {
      // K: under one block of 256, one and a part, two and a part; N: a partial tile, a partial block of 16, whole blocks.
      const shapes = [[64, 20], [300, 40], [513, 96]] as const
      const g = new GraphBuilder('m.onnx.data')
      shapes.forEach(([K, N], i) => {
        const x = g.input(`x${i}`, DT.FLOAT, ['m', K])
        const w = g.f32Weight(`w${i}`, [K, N], Float32Array.from({ length: K * N }, rand))
        g.output(`kernel${i}`, g.op('MatMulF32', `/kernel${i}`, [x, w], {}, NATIVE_KERNEL_DOMAIN), DT.FLOAT, ['m', N])
        g.output(`mlas${i}`, g.op('MatMul', `/mlas${i}`, [x, w]), DT.FLOAT, ['m', N])
      })
      await writeFile(join(dir, 'm.onnx'), g.encode('m', 'f32 products'))
      await writeFile(join(dir, 'm.onnx.data'), Buffer.concat(g.data()))
      const session = await createOrtSession(join(dir, 'm.onnx'), { threads: 2, kernels: lib })
      for (const M of [1, 2, 3, 5, 8, 9, 13, 40, 130]) {
        const feeds = Object.fromEntries(shapes.map(([K], i) => [`x${i}`, new ort.Tensor('float32', Float32Array.from({ length: M * K }, () => 4 * rand()), [M, K])]))
        const out = await session.run(feeds)
        for (const [i] of shapes.entries()) expect(sameBits(out[`kernel${i}`]!.data as Float32Array, out[`mlas${i}`]!.data as Float32Array), `shape ${i}, ${M} rows`).toBe(true)
      }
      await session.release()
    } finally {
      await rm(dir, { recursive: true, force: true })
    }
  })

  it('swapped at load, int4 shards give the logits of shards compiled with MatMulQ4 and DecodeAttention, bit for bit', async () => {
    const swapped = await engineOf(join(root, 'shard'), manifest, lib)
    const written = await engineOf(join(root, 'shard-q4'), compiled)
    const p = prompts[3]!
    const run = async (e: BatchingStageEngine): Promise<Float32Array[]> => {
      const seq = await e.open()
      const out: Float32Array[] = []
      let o = await e.step(seq, { tokenIds: p }, p.map((_, i) => i))
      for (let t = 0; t < 12; t++) {
        out.push(logitsOf(o))
        o = await e.step(seq, { tokenIds: [argmax(logitsOf(o))] }, [p.length + t])
      }
      await e.free(seq)
      return out
    }
    const [a, b] = [await run(swapped), await run(written)]
    expect(a).toHaveLength(12)
    for (const [i, x] of a.entries()) expect(sameBits(x, b[i]!), `step ${i}`).toBe(true)
  }, 120_000)

  it('a verify step (drafts, every position kept) gives each position the bits of one-position steps, after a prompt prefilled whole or chunked', async () => {
    const engine = await engineOf(join(root, 'shard'), manifest, lib)
    const p = prompts[2]!
    const N = 14
    const positions = (from: number, n: number): number[] => Array.from({ length: n }, (_, i) => from + i)
    // The reference: the prompt prefilled (GroupQueryAttention), then one position a step.
    const seq = await engine.open()
    const single = [logitsOf(await engine.step(seq, { tokenIds: p }, positions(0, p.length)))]
    const tokens: number[] = []
    for (let t = 0; t < N; t++) {
      tokens.push(argmax(single.at(-1)!))
      single.push(logitsOf(await engine.step(seq, { tokenIds: [tokens[t]!] }, [p.length + t])))
    }
    await engine.free(seq)
    // The same prompt, whole or in chunks of 7 and the rest, then its greedy continuation verified
    // as drafts: steps of 1 + 4 drafts, every position's logits kept.
    for (const chunks of [[p.length], [7, p.length - 7]]) {
      const s2 = await engine.open()
      let at = 0
      let last: StepOutput | undefined
      for (const n of chunks) { last = await engine.step(s2, { tokenIds: p.slice(at, at + n) }, positions(at, n)); at += n }
      const got = [logitsOf(last!)]
      for (let t = 0; t < N; t += 5) {
        const ids = tokens.slice(t, t + 5)
        got.push(...logitRows(await engine.step(s2, { tokenIds: ids }, positions(p.length + t, ids.length), { logitsToKeep: ids.length })))
      }
      await engine.free(s2)
      expect(got).toHaveLength(N + 1)
      for (const [i, x] of single.entries()) expect(sameBits(got[i]!, x), `chunks ${chunks.join('+')}, position ${p.length - 1 + i}`).toBe(true)
    }
  }, 120_000)

  it('on a chain\'s stages too: a verify step through the stages without a head (the first, a middle one), then the last, gives each position the bits of one-position steps', async () => {
    const dir = join(root, 'split')
    const m = await compileShards({ modelDir: join(root, 'ckpt'), outDir: dir, quant: 'int4', stages: 3 })
    expect(m.stages.map(st => [st.hasEmbedding, st.hasHead])).toEqual([[true, false], [false, false], [false, true]])
    const stageEngine = async (index: number): Promise<BatchingStageEngine> => {
      const st = m.stages[index]!
      const e = createStageEngine({
        graphPath: join(dir, ...st.graph.split('/')),
        ...(st.decodeGraph === undefined ? {} : { decodeGraphPath: join(dir, ...st.decodeGraph.split('/')) }),
        stage: stageInfoOf(m, index),
        threads: 1,
        maxSequences: 4,
        kernels: lib,
      })
      engines.push(e)
      await e.start()
      return e
    }
    const chain = [await stageEngine(0), await stageEngine(1), await stageEngine(2)]
    const hiddenOf = (out: StepOutput): Float32Array => { if (out.kind !== 'hidden') throw new Error(`a headless stage returned ${out.kind}`); return out.data }
    const p = prompts[0]!
    const positions = (from: number, n: number): number[] => Array.from({ length: n }, (_, i) => from + i)
    // Through the three stages: the prompt, then `steps` (each a list of ids, every position kept).
    // Each headless stage's hidden states are kept a position at a time (copies: the next stage's
    // step takes the buffer).
    const run = async (steps: number[][]): Promise<{ hidden: Float32Array[][], logits: Float32Array[] }> => {
      const seqs = await Promise.all(chain.map(async e => await e.open()))
      let h = hiddenOf(await chain[0]!.step(seqs[0]!, { tokenIds: p }, positions(0, p.length)))
      h = hiddenOf(await chain[1]!.step(seqs[1]!, { hidden: h }, positions(0, p.length)))
      await chain[2]!.step(seqs[2]!, { hidden: h }, positions(0, p.length))
      const hidden: Float32Array[][] = [[], []]
      const logits: Float32Array[] = []
      let at = p.length
      for (const ids of steps) {
        const keep = { logitsToKeep: ids.length }
        let x: { tokenIds: number[] } | { hidden: Float32Array } = { tokenIds: ids }
        for (const s of [0, 1]) {
          const out = hiddenOf(await chain[s]!.step(seqs[s]!, x, positions(at, ids.length), keep))
          const d = out.length / ids.length
          for (let i = 0; i < ids.length; i++) hidden[s]!.push(out.slice(i * d, (i + 1) * d))
          x = { hidden: out }
        }
        logits.push(...logitRows(await chain[2]!.step(seqs[2]!, x, positions(at, ids.length), keep)))
        at += ids.length
      }
      for (const [s, e] of chain.entries()) await e.free(seqs[s]!)
      return { hidden, logits }
    }
    const ids = [11, 222, 33, 444, 55, 6]
    const single = await run(ids.map(t => [t]))
    const verified = await run([ids])
    for (const s of [0, 1]) {
      for (const [i, h] of single.hidden[s]!.entries()) expect(sameBits(verified.hidden[s]![i]!, h), `stage ${s}, position ${p.length + i}`).toBe(true)
    }
    for (const [i, l] of single.logits.entries()) expect(sameBits(verified.logits[i]!, l), `last stage, position ${p.length + i}`).toBe(true)
  }, 120_000)

  it.each(['qwen2', 'qwen3', 'phi3', 'mixtral'] as const)('%s int4: a verify step gives each position the bits of one-position steps', async (architecture) => {
    const dir = join(root, `verify-${architecture}`)
    await generateTestModel({ architecture, outDir: join(dir, 'ckpt'), size: 'tiny' })
    const m = await compileShards({ modelDir: join(dir, 'ckpt'), outDir: join(dir, 'shard'), quant: 'int4' })
    const engine = await engineOf(join(dir, 'shard'), m, lib)
    const p = prompts[1]!.map(t => t % m.shape.vocabSize)
    const seq = await engine.open()
    const single = [logitsOf(await engine.step(seq, { tokenIds: p }, p.map((_, i) => i)))]
    const tokens: number[] = []
    for (let t = 0; t < 6; t++) {
      tokens.push(argmax(single.at(-1)!))
      single.push(logitsOf(await engine.step(seq, { tokenIds: [tokens[t]!] }, [p.length + t])))
    }
    await engine.free(seq)
    const v = await engine.open()
    const got = [logitsOf(await engine.step(v, { tokenIds: p }, p.map((_, i) => i)))]
    got.push(...logitRows(await engine.step(v, { tokenIds: tokens }, tokens.map((_, i) => p.length + i), { logitsToKeep: tokens.length })))
    await engine.free(v)
    for (const [i, x] of single.entries()) expect(sameBits(got[i]!, x), `position ${p.length - 1 + i}`).toBe(true)
  }, 120_000)

  it('a ragged batch of four gives each sequence its batch-of-one tokens bit for bit, whatever the CPU', async () => {
    const engine = await engineOf(join(root, 'shard'), manifest, lib)
    const alone: number[][] = []
    for (const p of prompts) alone.push(await greedyAlone(engine, p, TOKENS))
    // onnxruntime's MatMulNBits promises this only where its one-row kernel rounds as its batched
    // one does (AVX-512 VNNI; engine/kernel-probe.ts); the kernel's integer sums make it hold everywhere.
    expect(await greedyTogether(engine, prompts, TOKENS)).toEqual(alone)
  }, 120_000)

  /** A daemon serving `dir` (kernels as given; no speculation unless `draft`), its log lines, and `prompt`'s first 16 greedy tokens from it. */
  async function served (dir: string, name: string, prompt: number[], kernels?: 'onnxruntime', draft = 'none', modelId = manifest.modelId): Promise<{ lines: Array<Record<string, unknown>>, ids: number[] }> {
    const lines: Array<Record<string, unknown>> = []
    const logger = pino({ level: 'info' }, { write: (s: string) => { lines.push(JSON.parse(s) as Record<string, unknown>) } })
    const daemon = await startDaemon(dir, join(root, name), { draft, ...(kernels === undefined ? {} : { kernels }) }, logger)
    try {
      const r = await daemon.client.completions.create({
        model: modelId, prompt, max_tokens: 16, temperature: 0,
        // @ts-expect-error vLLM-style extension
        return_token_ids: true,
      })
      return { lines, ids: (r.choices[0] as unknown as { token_ids: number[] }).token_ids }
    } finally {
      await daemon.stop()
    }
  }

  it('a daemon serves int4 shards on it by default, says so, and answers as the engine does; `kernels: onnxruntime` keeps MatMulNBits', async () => {
    const p = prompts[0]!
    const expected = await greedyAlone(await engineOf(join(root, 'shard'), manifest, lib), p, 16)
    const auto = await served(join(root, 'shard'), 'auto', p)
    expect(auto.lines.find(l => l.msg === 'model loaded')?.int4Kernel).toBe('shoal')
    // On the kernel: the engine's tokens exactly.
    expect(auto.ids).toEqual(expected)
    const ort = await served(join(root, 'shard'), 'onnxruntime', p, 'onnxruntime')
    expect(ort.lines.find(l => l.msg === 'model loaded')?.int4Kernel).toBe('onnxruntime')
    // On MatMulNBits: its own tokens, equal but for a near tie.
    expect(ort.ids).toHaveLength(16)
  }, 180_000)

  it('a multi-stage int4 shard directory served as a local chain runs every stage on it, with the whole model\'s tokens', async () => {
    const L = manifest.shape.numLayers
    await compileShards({ modelDir: join(root, 'ckpt'), outDir: join(root, 'shard-2'), quant: 'int4', layers: [[0, L / 2 - 1], [L / 2, L - 1]] })
    const p = prompts[1]!
    const expected = await greedyAlone(await engineOf(join(root, 'shard'), manifest, lib), p, 16)
    const chain = await served(join(root, 'shard-2'), 'chain', p)
    expect(chain.lines.find(l => l.msg === 'model loaded as a local chain')?.int4Kernel).toBe('shoal')
    expect(chain.ids).toEqual(expected)
  }, 180_000)

  it('int4 shards on them speculate by default (prompt lookup), and their tokens are plain decoding\'s', async () => {
    // Text that repeats, so lookup drafts and the target accepts; 96 tokens of it.
    const p = Array.from({ length: 24 }, (_, i) => 40 + (i % 6))
    const expected = await greedyAlone(await engineOf(join(root, 'shard'), manifest, lib), p, 96)
    const lines: Array<Record<string, unknown>> = []
    const logger = pino({ level: 'info' }, { write: (s: string) => { lines.push(JSON.parse(s) as Record<string, unknown>) } })
    const daemon = await startDaemon(join(root, 'shard'), join(root, 'lookup'), {}, logger)
    try {
      const loaded = lines.find(l => l.msg === 'model loaded')
      expect(loaded?.drafter).toBe('prompt-lookup (default)')
      expect(loaded?.promptLookup).toBeUndefined()
      expect(loaded?.verifyKernel).toBe('shoal')
      const r = await daemon.client.completions.create({
        model: manifest.modelId, prompt: p, max_tokens: 96, temperature: 0,
        // @ts-expect-error vLLM-style extension
        return_token_ids: true,
      })
      expect((r.choices[0] as unknown as { token_ids: number[] }).token_ids).toEqual(expected)
      const metrics = await (await fetch(`${daemon.url}/metrics`)).text()
      const accepted = Number(/^shoal_speculative_accepted_tokens_total\{[^}]*\} (\d+)/m.exec(metrics)?.[1] ?? 0)
      console.log(`int4 on the kernels, default prompt lookup: ${accepted} of 96 tokens accepted drafts`)
      expect(accepted).toBeGreaterThan(0)
    } finally {
      await daemon.stop()
    }
  }, 180_000)

  it('a draft model (--draft DIR) runs on them too, and speculation keeps the target\'s tokens', async () => {
    // The target must compute in f32 activations to speculate on (fp32 here: the attention
    // kernel); the int4 shards draft, on both kernels.
    const target = await compileShards({ modelDir: join(root, 'ckpt'), outDir: join(root, 'shard-fp32'), quant: 'none' })
    const p = prompts[2]!
    const expected = await greedyAlone(await engineOf(join(root, 'shard-fp32'), target, lib), p, 16)
    const spec = await served(join(root, 'shard-fp32'), 'draft', p, undefined, join(root, 'shard'), target.modelId)
    const loaded = spec.lines.find(l => l.msg === 'model loaded')
    expect(loaded?.drafter).toBe(`draft:${manifest.modelId}`)
    expect(loaded?.draftKernels).toEqual(['int4', 'attention', 'verify'])
    expect(loaded?.attentionKernel).toBe('shoal')
    expect(spec.ids).toEqual(expected)
  }, 180_000)

  it('int4 experts spread over two holders run on it, stage and holders, with the one graph\'s tokens on it', async () => {
    const ckpt = join(root, 'moe')
    await generateTestModel({ architecture: 'qwen2-moe', outDir: ckpt, seed: 4 })
    const dir = join(root, 'moe-experts')
    const layout = await compileExpertShards({ modelDir: ckpt, outDir: dir, quant: 'int4' })
    expect(int4ProductsTakeKernel(layout.quantization)).toBe(true)
    // Every expert's products are ones the kernel takes (the stage's attention projections too).
    const expert = layout.layers.flatMap(l => l.experts ?? [])[0]!
    expect(swapKernels(await readFile(join(dir, ...expert.split('/')))).int4).toBeGreaterThan(0)
    const whole = await compileShards({ modelDir: ckpt, outDir: join(root, 'moe-whole'), quant: 'int4' })
    const one: Pipeline = { manifest: whole, sessions: [await createOrtSession(join(root, 'moe-whole', whole.stages[0]!.graph), { threads: 1, kernels: lib })], release: async () => {} }
    const p = prompts[0]!
    const expected = await greedyDecode(one, p, 24)
    await one.sessions[0]!.release()
    const plan = planFor(layout, 2)
    const holders = await startHolders(dir, layout, plan, lib)
    const stage = stageFor(dir, layout, plan, linkTo(holders, new Set()), lib)
    await stage.open()
    try {
      expect((await stage.greedy([p], 24)).tokens[0]).toEqual(expected.tokens)
    } finally {
      await stage.close()
      for (const h of holders.values()) await h.stop()
    }
  }, 180_000)
})
