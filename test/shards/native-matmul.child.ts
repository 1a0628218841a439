/**
 * Run by native-matmul.test.ts in a process with the benchmark kernels preloaded
 * (reproduction/lib/native-kernels.ts): for every test architecture, int4 'ort-contrib' shards
 * with the native int4 kernel (MatMulQ4) against the same shards with onnxruntime's MatMulNBits,
 * both with int8 activations, and against MatMulNBits with f32 activations (accuracy level 0: the
 * int4 weights without the activations' rounding). Greedy tokens, logits while two sequences
 * agree, and the kernel's batched decode against each row alone. Prints one JSON line per
 * architecture.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { compileShards, generateTestModel, TEST_ARCHITECTURES } from '../../shards/index.ts'
import { batchedAgainstAlone, encodePrompt, greedyDecode, openPipeline } from './pipeline.ts'

const N = 48
type Run = { tokens: number[], logits: Float32Array[] }

const maxDiff = (a: ArrayLike<number>, b: ArrayLike<number>): number => {
  let m = 0
  for (let i = 0; i < a.length; i++) m = Math.max(m, Math.abs(a[i]! - b[i]!))
  return m
}
/** The best logit less the second best. */
const margin = (l: Float32Array): number => {
  let a = -Infinity
  let b = -Infinity
  for (const v of l) {
    if (v > a) { b = a; a = v } else if (v > b) b = v
  }
  return a - b
}
/** The first step whose tokens differ (N when none): up to it both decoded the same sequence. */
const split = (a: Run, b: Run): number => {
  const i = a.tokens.findIndex((t, j) => t !== b.tokens[j])
  return i < 0 ? N : i
}
/** The largest logit difference over the steps both saw the same sequence (the split's included). */
const logitDiff = (a: Run, b: Run): number => Math.max(...a.logits.slice(0, Math.min(split(a, b) + 1, N)).map((l, i) => maxDiff(l, b.logits[i]!)))

const root = await mkdtemp(join(tmpdir(), 'shoal-native-matmul-'))
try {
  for (const arch of TEST_ARCHITECTURES) {
    const modelDir = join(root, arch)
    await generateTestModel({ architecture: arch, outDir: modelDir, seed: 4 })
    const prompt = await encodePrompt(modelDir, 'The quick brown fox jumps over the lazy dog. Once upon a time')
    const run = async (kernel: 'native' | undefined, accuracyLevel: 0 | 4): Promise<Run & { batched: string[], kernel: string | undefined }> => {
      const dir = join(root, `${arch}-${kernel ?? 'ort'}-${accuracyLevel}`)
      const m = await compileShards({ modelDir, outDir: dir, opSet: 'ort-contrib', quant: 'int4', accuracyLevel, decodeAttention: 'per-head', ...(kernel === undefined ? {} : { kernel }) })
      const p = await openPipeline(dir, m)
      try {
        const greedy = await greedyDecode(p, prompt, N)
        const rows = [prompt.slice(0, 4), prompt.slice(0, 9), prompt, prompt.slice(0, 1)]
        return { ...greedy, batched: kernel === 'native' ? await batchedAgainstAlone(p, rows, 4, 16) : [], kernel: m.quantization.kind === 'int4' ? m.quantization.kernel : undefined }
      } finally {
        await p.release()
      }
    }
    const ort = await run(undefined, 4)
    const native = await run('native', 4)
    const f32 = await run(undefined, 0)
    const at = split(native, ort)
    process.stdout.write(`${JSON.stringify({
      arch,
      kernel: native.kernel,
      tokens: N,
      agree: at,
      marginAtSplit: at < N ? margin(ort.logits[at]!) : null,
      vsMatMulNBits: logitDiff(native, ort),
      // What int8 activations cost MatMulNBits itself, against f32 activations.
      matMulNBitsVsF32: logitDiff(ort, f32),
      nativeVsF32: logitDiff(native, f32),
      batchedMismatches: native.batched,
    })}\n`)
  }
} finally {
  await rm(root, { recursive: true, force: true })
}
