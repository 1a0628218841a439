/**
 * Run by native-attention.test.ts in a process with the fused attention kernel preloaded
 * (reproduction/lib/native-kernels.ts): for every test architecture (tiny, fp32, 'ort-contrib'),
 * the 'native' decode-attention form's greedy tokens against the float64 reference and its logits
 * against the shipped per-head form, and its batched decode against each row alone. Prints one
 * JSON line per architecture.
 */
import { join } from 'node:path'
import { compileShards } from '../../shards/index.ts'
import { ReferenceModel } from '../support/reference.ts'
import { batchedAgainstAlone, eachTestModel, greedyDecode, maxDiff, raggedRows, withPipeline } from './pipeline.ts'

const N = 64

await eachTestModel('shoal-native-attention-', async (arch, modelDir, prompt, root) => {
  const ref = new ReferenceModel(modelDir).greedy(prompt, N)
  const run = async (form: 'per-head' | 'native'): Promise<{ tokens: number[], logits: Float32Array[], batched: string[] }> => {
    const dir = join(root, `${arch}-${form}`)
    const m = await compileShards({ modelDir, outDir: dir, opSet: 'ort-contrib', decodeAttention: form })
    return await withPipeline(dir, m, async p => ({
      ...await greedyDecode(p, prompt, N),
      batched: form === 'native' ? await batchedAgainstAlone(p, raggedRows(prompt), 4, 16) : [],
    }))
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
})
