/**
 * Run by native-attention.test.ts in a process with the fused attention kernel preloaded
 * (reproduction/lib/native-kernels.ts): for every test architecture (tiny, fp32, 'ort-contrib'),
 * the 'native' decode-attention form's greedy tokens against the float64 reference and its logits
 * against the shipped per-head form, and its batched decode against each row alone. Prints one
 * JSON line per architecture.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { compileShards, generateTestModel, TEST_ARCHITECTURES } from '../../shards/index.ts'
import { ReferenceModel } from '../support/reference.ts'
import { batchedAgainstAlone, encodePrompt, greedyDecode, openPipeline } from './pipeline.ts'

const N = 64
const maxDiff = (a: ArrayLike<number>, b: ArrayLike<number>): number => {
  let m = 0
  for (let i = 0; i < a.length; i++) m = Math.max(m, Math.abs(a[i]! - b[i]!))
  return m
}

const root = await mkdtemp(join(tmpdir(), 'shoal-native-attention-'))
try {
  for (const arch of TEST_ARCHITECTURES) {
    const modelDir = join(root, arch)
    await generateTestModel({ architecture: arch, outDir: modelDir, seed: 4 })
    const prompt = await encodePrompt(modelDir, 'The quick brown fox jumps over the lazy dog. Once upon a time')
    const ref = new ReferenceModel(modelDir).greedy(prompt, N)
    const run = async (form: 'per-head' | 'native'): Promise<{ tokens: number[], logits: Float32Array[], batched: string[] }> => {
      const dir = join(root, `${arch}-${form}`)
      const m = await compileShards({ modelDir, outDir: dir, opSet: 'ort-contrib', decodeAttention: form })
      const p = await openPipeline(dir, m)
      try {
        const greedy = await greedyDecode(p, prompt, N)
        const rows = [prompt.slice(0, 4), prompt.slice(0, 9), prompt, prompt.slice(0, 1)]
        return { ...greedy, batched: form === 'native' ? await batchedAgainstAlone(p, rows, 4, 16) : [] }
      } finally {
        await p.release()
      }
    }
    const perHead = await run('per-head')
    const native = await run('native')
    process.stdout.write(`${JSON.stringify({
      arch,
      tokens: native.tokens,
      reference: ref.tokens,
      vsPerHead: Math.max(...native.logits.map((l, i) => maxDiff(l, perHead.logits[i]!))),
      vsReference: Math.max(...native.logits.map((l, i) => maxDiff(l, ref.logits[i]!))),
      batchedMismatches: native.batched,
    })}\n`)
  }
} finally {
  await rm(root, { recursive: true, force: true })
}
