/**
 * Run by native-matmul.test.ts in a process with shoal's kernel library preloaded
 * (reproduction/lib/native-kernels.ts): for every test architecture, int4 'ort-contrib' shards
 * with the native int4 kernel (MatMulQ4) against the same shards with onnxruntime's MatMulNBits,
 * both with int8 activations, and against MatMulNBits with f32 activations (accuracy level 0: the
 * int4 weights without the activations' rounding). Greedy tokens, logits while two sequences
 * agree, and the kernel's batched decode against each row alone. Prints one JSON line per
 * architecture.
 */
import { join } from 'node:path'
import { compileShards } from '../../shards/index.ts'
import { batchedAgainstAlone, eachTestModel, greedyDecode, greedySplit, raggedRows, withPipeline } from './pipeline.ts'

const N = 48
await eachTestModel('shoal-native-matmul-', async (arch, modelDir, prompt, root) => {
  const run = async (kernel: 'native' | undefined, accuracyLevel: 0 | 4): Promise<{ tokens: number[], logits: Float32Array[], batched: string[], kernel: string | undefined }> => {
    const dir = join(root, `${arch}-${kernel ?? 'ort'}-${accuracyLevel}`)
    const m = await compileShards({ modelDir, outDir: dir, opSet: 'ort-contrib', quant: 'int4', accuracyLevel, decodeAttention: 'per-head', ...(kernel === undefined ? {} : { kernel }) })
    return await withPipeline(dir, m, async p => ({
      ...await greedyDecode(p, prompt, N),
      batched: kernel === 'native' ? await batchedAgainstAlone(p, raggedRows(prompt), 4, 16) : [],
      kernel: m.quantization.kind === 'int4' ? m.quantization.kernel : undefined,
    }))
  }
  const ort = await run(undefined, 4)
  const native = await run('native', 4)
  const f32 = await run(undefined, 0)
  const vsOrt = greedySplit(native, ort)
  process.stdout.write(`${JSON.stringify({
    arch,
    kernel: native.kernel,
    tokens: N,
    agree: vsOrt.at,
    marginAtSplit: vsOrt.margin ?? null,
    vsMatMulNBits: vsOrt.diff,
    // What int8 activations cost MatMulNBits itself, against f32 activations.
    matMulNBitsVsF32: greedySplit(ort, f32).diff,
    nativeVsF32: greedySplit(native, f32).diff,
    batchedMismatches: native.batched,
  })}\n`)
})
