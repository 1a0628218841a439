/**
 * int8/int4 (MatMulNBits) shards: report greedy token agreement and the largest logit error
 * against fp32 shards of the same checkpoint. Quantization changes numbers by design, so the
 * assertions are loose sanity checks; the numbers are printed for the record.
 */
import { copyFile, mkdir, mkdtemp, readFile, rm, stat, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import fc from 'fast-check'
import * as ort from 'onnxruntime-node'
import { compileShards, generateTestModel } from '../../shards/index.ts'
import { embeddingStorage, dequantizeMatrix, quantizeMatrix, roundToHalf } from '../../shards/quant.ts'
import { GraphBuilder, DT } from '../../shards/graph/builder.ts'
import { makeEmbedding } from '../../shards/graph/blocks.ts'
import type { BuildContext } from '../../shards/graph/types.ts'
import type { Quantization } from '../../shards/contract.ts'
import { openWeights, writeSafetensors } from '../../shards/safetensors.ts'
import { greedyDecode, openPipeline, prefill } from './pipeline.ts'

const N = 64
let root: string
let modelDir: string
let fp32: { tokens: number[], forced: Float32Array }
const prompt = [507, 84, 104, 101, 32, 113, 117, 105, 99, 107]

beforeAll(async () => {
  root = await mkdtemp(join(tmpdir(), 'shoal-quant-'))
  modelDir = join(root, 'llama')
  await generateTestModel({ architecture: 'llama', outDir: modelDir, seed: 4, size: 'tiny' })
  const m = await compileShards({ modelDir, outDir: join(root, 'fp32') })
  const p = await openPipeline(join(root, 'fp32'), m)
  const r = await greedyDecode(p, prompt, N)
  const forced = (await prefill(p, [[...prompt, ...r.tokens]], 0)).logits
  await p.release()
  fp32 = { tokens: r.tokens, forced }
})
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

describe('quantized shards vs fp32', () => {
  for (const quant of ['int8', 'int4'] as const) {
    for (const blockSize of [32, 128] as const) {
      for (const accuracyLevel of [0, 4] as const) {
        it(`${quant} block ${blockSize} accuracy_level ${accuracyLevel}`, async () => {
          const out = join(root, `${quant}-${blockSize}-${accuracyLevel}`)
          const m = await compileShards({ modelDir, outDir: out, quant, blockSize, accuracyLevel, stages: 2 })
          // Hidden size 64: one 32-block grid, not a 128 one (that embedding stays f32).
          expect(m.quantization).toEqual({ kind: quant, blockSize, activations: accuracyLevel === 4 ? 'int8' : 'f32', ...(quant === 'int4' ? { embedding: blockSize === 32 ? 'int4' : 'f32' } : {}) })
          const p = await openPipeline(out, m)
          try {
            const r = await greedyDecode(p, prompt, N)
            // Teacher-forced on the fp32 continuation, so every position compares the same context.
            const forced = (await prefill(p, [[...prompt, ...fp32.tokens]], 0)).logits
            let maxErr = 0
            for (let i = 0; i < forced.length; i++) maxErr = Math.max(maxErr, Math.abs(forced[i]! - fp32.forced[i]!))
            let prefix = 0
            while (prefix < N && r.tokens[prefix] === fp32.tokens[prefix]) prefix++
            const agree = r.tokens.filter((t, i) => t === fp32.tokens[i]).length
            console.log(`${quant} b${blockSize} acc${accuracyLevel}: greedy agreement ${agree}/${N} (identical prefix ${prefix}), max |logit − fp32| ${maxErr.toFixed(4)} (teacher-forced, ${forced.length} logits)`)
            expect(forced.every(Number.isFinite)).toBe(true)
            // Random Gaussian weights are quantization-hostile (no outliers to spare, K = 64), so
            // int4 moves tiny-model logits by several units; the bound only catches garbage.
            expect(maxErr).toBeLessThan(quant === 'int8' ? 2 : 10)
          } finally {
            await p.release()
          }
        })
      }
    }
  }
})

describe('MatMulNBits graphs compute exactly the dequantized weights', () => {
  // qwen2 ties its head to the embedding: both are quantized from the same tensor by the same quantizer.
  for (const [quant, arch] of [['int8', 'llama'], ['int4', 'llama'], ['int4', 'qwen2']] as const) {
    it(`${quant} ${arch}${arch === 'qwen2' ? ' (tied)' : ''}: accuracy_level 0 matches fp32 shards of the dequantized checkpoint`, async () => {
      let modelDir = join(root, 'llama')
      if (arch !== 'llama') {
        modelDir = join(root, arch)
        await generateTestModel({ architecture: arch, outDir: modelDir, seed: 4, size: 'tiny' })
        expect(JSON.parse(await readFile(join(modelDir, 'config.json'), 'utf8')).tie_word_embeddings).toBe(true)
      }
      // Rewrite the checkpoint with every quantized matrix replaced by its dequantized value.
      const dq = join(root, `dequant-${quant}-${arch}`)
      await mkdir(dq, { recursive: true })
      for (const f of ['config.json', 'tokenizer.json', 'tokenizer_config.json', 'generation_config.json']) await copyFile(join(modelDir, f), join(dq, f))
      const w = await openWeights(modelDir)
      const tensors = []
      for (const name of w.names()) {
        const t = await w.get(name)
        // int4 shards quantize the embedding too (GatherBlockQuantized); int8 shards keep it f32.
        const quantized = t.shape.length === 2 && (name !== 'model.embed_tokens.weight' || quant === 'int4')
        tensors.push({ name, shape: t.shape, data: quantized ? dequantizeMatrix(quantizeMatrix(t.data, t.shape[0]!, t.shape[1]!, quant === 'int4' ? 4 : 8, 32)) : t.data })
      }
      await writeSafetensors(join(dq, 'model.safetensors'), tensors)
      const mq = await compileShards({ modelDir, outDir: join(root, `q-${quant}-${arch}`), quant, blockSize: 32, accuracyLevel: 0 })
      const mf = await compileShards({ modelDir: dq, outDir: join(root, `dqf-${quant}-${arch}`) })
      expect(mq.quantization).toMatchObject(quant === 'int4' ? { embedding: 'int4' } : {})
      const pq = await openPipeline(join(root, `q-${quant}-${arch}`), mq)
      const pf = await openPipeline(join(root, `dqf-${quant}-${arch}`), mf)
      try {
        const rq = await greedyDecode(pq, prompt, N)
        const rf = await greedyDecode(pf, prompt, N)
        let maxErr = 0
        rq.logits.forEach((l, i) => l.forEach((v, j) => { maxErr = Math.max(maxErr, Math.abs(v - rf.logits[i]![j]!)) }))
        console.log(`${quant} ${arch} MatMulNBits vs f32 MatMul on dequantized weights: max |logit diff| ${maxErr.toExponential(2)}`)
        expect(rq.tokens).toEqual(rf.tokens)
        expect(maxErr).toBeLessThan(1e-3)
      } finally {
        await pq.release()
        await pf.release()
      }
    })
  }
})

describe('quantizeMatrix', () => {
  it('dequantizes within half a step of every weight, padding blocks past K', () => {
    fc.assert(fc.property(
      fc.constantFrom(4 as const, 8 as const), fc.constantFrom(32, 128), fc.integer({ min: 1, max: 4 }), fc.integer({ min: 1, max: 200 }), fc.integer(),
      (bits, blockSize, n, k, seed) => {
        let s = seed >>> 0
        const w = Float32Array.from({ length: n * k }, () => { s = (Math.imul(s, 1664525) + 1013904223) >>> 0; return (s / 2 ** 32 - 0.5) * 4 })
        const q = quantizeMatrix(w, n, k, bits, blockSize)
        expect(q.data.length).toBe(n * Math.ceil(k / blockSize) * blockSize * bits / 8)
        const d = dequantizeMatrix(q)
        for (let r = 0; r < n; r++) {
          for (let i = 0; i < k; i++) {
            const scale = q.scales[r * Math.ceil(k / blockSize) + Math.floor(i / blockSize)]!
            if (Math.abs(d[r * k + i]! - w[r * k + i]!) > scale / 2 + 1e-6) return false
          }
        }
        return true
      }), { numRuns: 60 })
  })
})

describe('4-bit scales are IEEE halves (compiler 14)', () => {
  /** The half nearest x (ties to even) by Math.f16round, where this Node has it (24 and later). */
  const f16round = (Math as { f16round?: (x: number) => number }).f16round

  it('roundToHalf is the nearest half, ties to even, subnormals included', () => {
    expect(roundToHalf(1)).toBe(1)
    expect(roundToHalf(1 + 2 ** -11)).toBe(1) // a tie: to the even significand
    expect(roundToHalf(1 + 3 * 2 ** -11)).toBe(1 + 2 ** -9)
    expect(roundToHalf(65504)).toBe(65504)
    expect(roundToHalf(1e6)).toBe(65504) // past the largest half: that half
    expect(roundToHalf(2 ** -24)).toBe(2 ** -24)
    expect(roundToHalf(2 ** -26)).toBe(0)
    expect(roundToHalf(-0.1)).toBe(-roundToHalf(0.1))
    fc.assert(fc.property(fc.double({ min: -65504, max: 65504, noNaN: true }), x => {
      const h = roundToHalf(x)
      // A half: a whole number of its binade's units, ten significand bits.
      const a = Math.abs(h)
      if (a !== 0) {
        const ulp = 2 ** (Math.max(Math.floor(Math.log2(a)), -14) - 10)
        if (a / ulp !== Math.floor(a / ulp) || a / ulp >= 2048) return false
      }
      return f16round === undefined || Object.is(f16round(x), h)
    }), { numRuns: 2000 })
  })

  it('quantizeMatrix gives 4-bit blocks half scales (8-bit ones keep f32), never 0 where a weight is not', () => {
    fc.assert(fc.property(fc.integer(), fc.double({ min: 1e-9, max: 100, noNaN: true }), (seed, spread) => {
      let s = seed >>> 0
      const w = Float32Array.from({ length: 4 * 96 }, () => { s = (Math.imul(s, 1664525) + 1013904223) >>> 0; return (s / 2 ** 32 - 0.5) * spread })
      const q4 = quantizeMatrix(w, 4, 96, 4, 32)
      if (!Array.from(q4.scales).every(x => roundToHalf(x) === x && x > 0)) return false
      const q8 = quantizeMatrix(w, 4, 96, 8, 32)
      return Array.from(q8.scales).every(x => x === Math.fround(x) && x > 0)
    }), { numRuns: 200 })
  })
})

describe('int4 token embedding (standard-op lookup of 4-bit blocks)', () => {
  /** A graph of makeEmbedding alone, fed ids as [2, ids.length / 2]; returns the looked-up rows [ids.length, D]. */
  async function lookup (embed: { shape: number[], data: Float32Array }, quant: Quantization, ids: number[], portable: boolean): Promise<Float32Array> {
    const dir = await mkdtemp(join(root, 'emb-'))
    const g = new GraphBuilder('emb.onnx.data')
    const ctx = { g, quant, accuracyLevel: 0 } as unknown as BuildContext
    const x = makeEmbedding(ctx, g.input('input_ids', DT.INT64, ['B', 'S']), embed, portable)
    g.output('rows', x, DT.FLOAT, ['B', 'S', embed.shape[1]!])
    await writeFile(join(dir, 'emb.onnx'), g.encode('emb', ''))
    await writeFile(join(dir, 'emb.onnx.data'), Buffer.concat(g.data()))
    const s = await ort.InferenceSession.create(join(dir, 'emb.onnx'))
    try {
      const r = await s.run({ input_ids: new ort.Tensor('int64', BigInt64Array.from(ids.map(BigInt)), [2, ids.length / 2]) })
      return r.rows!.data as Float32Array
    } finally {
      await s.release()
    }
  }

  it('reads exactly dequantize(quantize(row)) with the MatMulNBits quantizer, and the portable Gather reads the same', async () => {
    const embed = await (await openWeights(modelDir)).get('model.embed_tokens.weight')
    const [V, D] = embed.shape as [number, number]
    const ids = [0, 1, 7, 255, V - 1, 7]
    for (const blockSize of [32, 64] as const) {
      const quant = { kind: 'int4', blockSize, activations: 'f32', embedding: 'int4' } as Quantization
      const ref = dequantizeMatrix(quantizeMatrix(embed.data, V, D, 4, blockSize))
      const want = new Float32Array(ids.length * D)
      ids.forEach((t, i) => { want.set(ref.subarray(t * D, (t + 1) * D), i * D) })
      const got = await lookup(embed, quant, ids, false)
      expect(Buffer.from(got.buffer, got.byteOffset, got.byteLength).equals(Buffer.from(want.buffer))).toBe(true)
      const portable = await lookup(embed, quant, ids, true)
      expect(Buffer.from(portable.buffer, portable.byteOffset, portable.byteLength).equals(Buffer.from(want.buffer))).toBe(true)
      // Not the f32 rows: the lookup really is quantized.
      expect(want.some((v, i) => v !== embed.data[ids[Math.floor(i / D)]! * D + (i % D)])).toBe(true)
    }
  })

  it('is the int4 default, kept f32 on request, for int8, and for a hidden size off the block grid', () => {
    expect(embeddingStorage('int4', 'int4', 512, 32)).toBe('int4')
    expect(embeddingStorage('int4', 'f32', 512, 32)).toBe('f32')
    expect(embeddingStorage('int8', 'int4', 512, 32)).toBe('f32')
    expect(embeddingStorage('none', 'int4', 512, 32)).toBe('f32')
    expect(embeddingStorage('int4', 'int4', 96, 64)).toBe('f32')
  })

  it('shrinks the shard by the f32 table less its 4-bit blocks and scales; --f32-embedding keeps today\'s graph', async () => {
    const q = await compileShards({ modelDir, outDir: join(root, 'emb-q4'), quant: 'int4' })
    const f = await compileShards({ modelDir, outDir: join(root, 'emb-f32'), quant: 'int4', embedding: 'f32' })
    expect(q.quantization).toMatchObject({ embedding: 'int4' })
    expect(f.quantization).toMatchObject({ embedding: 'f32' })
    const { vocabSize: V, hiddenSize: D } = q.shape
    const bytes = async (dir: string): Promise<number> => (await stat(join(dir, 'stage-0', 'model.onnx.data'))).size
    expect(await bytes(join(root, 'emb-f32')) - await bytes(join(root, 'emb-q4'))).toBe(V * D * 4 - V * D / 2 - V * (D / 32) * 4)
  })
})
