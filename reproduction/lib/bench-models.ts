/**
 * The models shoal is measured against llama.cpp on (bench-vs-llamacpp.ts, paired-vs-llamacpp.ts):
 * one generated Llama checkpoint per size (random weights, real shapes; seed 1), shoal shards
 * compiled from it per quant, and a GGUF written from the same tensors (F32, or Q4_0 with ggml's
 * reference quantizer). Each is made once under .cache/bench-vs-llamacpp/ and reused; shards are
 * named by compiler version, so shards compiled by an older shoal are never measured as the newest.
 */
import { existsSync } from 'node:fs'
import { mkdir, readFile, rename, writeFile } from 'node:fs/promises'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { COMPILER_VERSION, compileShards, generateTestModel, loadManifest } from '../../shards/index.ts'
import type { TestModelSize } from '../../shards/index.ts'
import { decodeAttentionForm } from '../../daemon/engine/index.ts'
import { checkpointToGguf } from '../gguf.ts'
import type { NativeKernels } from './native-kernels.ts'

export const BENCH_MODELS_DIR = join(resolve(import.meta.dirname, '..', '..'), '.cache', 'bench-vs-llamacpp')

export interface ModelFiles { size: string, quant: 'none' | 'int4', shards: string, modelId: string, gguf: string, shoalWeightBytes: number, ggufWeightBytes: number }

/** Makes `target` with `make` (into a temporary path, renamed when done) unless it exists. */
async function once (target: string, make: (tmp: string) => Promise<unknown>, log: (s: string) => void): Promise<void> {
  if (existsSync(target)) return
  const tmp = `${target}.tmp-${process.pid}`
  const t = performance.now()
  await make(tmp)
  await rename(tmp, target)
  log(`made ${target} in ${((performance.now() - t) / 1000).toFixed(1)} s`)
}

/** The generated checkpoint of a size (ensureModel makes it). */
const checkpointDir = (size: string): string => join(BENCH_MODELS_DIR, `llama-${size}`)

export async function ensureModel (size: TestModelSize, quant: 'none' | 'int4', log: (s: string) => void = () => {}): Promise<ModelFiles> {
  await mkdir(BENCH_MODELS_DIR, { recursive: true })
  const ckpt = checkpointDir(size)
  await once(ckpt, async tmp => { await generateTestModel({ architecture: 'llama', size, outDir: tmp, seed: 1 }) }, log)
  const modelId = `llama-${size}-${quant === 'none' ? 'fp32' : quant}`
  const shards = join(BENCH_MODELS_DIR, `${modelId}-c${COMPILER_VERSION}`)
  // The one-position attention's form this CPU runs faster, as `shoal shard` chooses it.
  await once(shards, async tmp => await compileShards({ modelDir: ckpt, outDir: tmp, quant, modelId, decodeAttention: async shape => (await decodeAttentionForm(shape)).form }), log)
  const gguf = join(BENCH_MODELS_DIR, `llama-${size}-${quant === 'none' ? 'f32' : 'q4_0'}.gguf`)
  await once(gguf, async tmp => {
    const bytes = await checkpointToGguf(ckpt, tmp, quant === 'none' ? 'f32' : 'q4_0')
    await writeFile(`${gguf}.bytes`, `${bytes}\n`)
  }, log)
  const manifest = await loadManifest(shards)
  const shoalWeightBytes = manifest.stages[0]!.files.reduce((a, f) => a + f.bytes, 0)
  return { size, quant, shards, modelId, gguf, shoalWeightBytes, ggufWeightBytes: Number(await readFile(`${gguf}.bytes`, 'utf8')) }
}

/**
 * `m`'s checkpoint compiled again for the benchmark kernels of
 * daemon/engine/native/ort-kernels.c, which only a process with that library preloaded can
 * run (lib/native-kernels.ts): 'attention' the 'native' one-position attention, 'int4' the
 * int4 products as MatMulQ4 (int4 models only), 'both' the two. Beside `m`'s shards, under the
 * same model id; its directory.
 */
export async function ensureNativeShards (m: ModelFiles, kernels: NativeKernels = 'attention', log: (s: string) => void = () => {}): Promise<string> {
  if (kernels !== 'attention' && m.quant !== 'int4') throw new Error(`the native int4 kernel needs an int4 model, not ${m.modelId}`)
  const shards = join(BENCH_MODELS_DIR, `${m.modelId}-native${kernels === 'attention' ? '' : `-${kernels}`}-c${COMPILER_VERSION}`)
  await once(shards, async tmp => await compileShards({
    modelDir: checkpointDir(m.size), outDir: tmp, quant: m.quant, modelId: m.modelId,
    decodeAttention: kernels === 'int4' ? async shape => (await decodeAttentionForm(shape)).form : 'native',
    ...(kernels === 'attention' ? {} : { kernel: 'native' as const }),
  }), log)
  return shards
}

/**
 * A command line's quant name: 'none' (alias 'fp32', as the model ids print it) or 'int4'.
 * Anything else is refused: 'fp32' used to be taken for a quant of its own, which served shoal's
 * f32 shard against llama-server on the Q4_0 GGUF.
 */
export function parseQuant (name: string): 'none' | 'int4' {
  if (name === 'none' || name === 'fp32') return 'none'
  if (name === 'int4') return 'int4'
  throw new Error(`unknown quant ${JSON.stringify(name)}: none (or fp32), int4`)
}

/** Every size × quant of the command line's comma-separated lists, made when missing, in that order. */
export async function ensureModels (sizes: string, quants: string, log: (s: string) => void = () => {}): Promise<ModelFiles[]> {
  const qs = quants.split(',').map(parseQuant) // all checked before anything is made
  const models: ModelFiles[] = []
  for (const size of sizes.split(',') as TestModelSize[]) for (const q of qs) models.push(await ensureModel(size, q, log))
  return models
}
