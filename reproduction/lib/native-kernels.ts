/**
 * shoal's kernel library (daemon/engine/native: the int4 product nodes run, and the fused
 * one-position attention of the 'native' decode-attention form, a benchmark's so far) for the
 * processes that measure or test them, built under the repository's cache; and the bare C loop of
 * the attention (buildFusedLoop). A benchmark process gets the library through LD_PRELOAD
 * (nativeKernelsEnv) or `process.dlopen`, as the daemon does.
 */
import { join, resolve } from 'node:path'
import { kernelsApplying, prepareNativeKernels } from '../../daemon/engine/index.ts'
import { buildC, buildKernelLibrary } from '../../daemon/engine/native/build.ts'
import type { ShardManifest } from '../../shards/index.ts'

export { hasCompiler } from '../../daemon/engine/native/build.ts'

const ROOT = resolve(import.meta.dirname, '..', '..')
const CACHE = join(ROOT, '.cache', 'native-kernels')

/** Which kernels a benchmark arm's shards are compiled for: the attention, the int4 products, or both. */
export type NativeKernels = 'attention' | 'int4' | 'both'

/** Builds the kernel library (once per source and CPU) under `cacheDir`; its absolute path. */
export async function buildNativeKernels (cacheDir = CACHE): Promise<string> {
  return await buildKernelLibrary(cacheDir)
}

/**
 * Builds the bare C loop of the same work (reproduction/native/fused-attention.c, a program timing
 * itself; bench-decode-attention.ts `--native`) with fast-math, as wave 33 timed it; its path.
 */
export async function buildFusedLoop (cacheDir = CACHE): Promise<string> {
  return await buildC({ source: join(ROOT, 'reproduction', 'native', 'fused-attention.c'), name: 'fused-attention', flags: ['-O3', '-march=native', '-ffast-math'], libs: ['-lm'] }, cacheDir)
}

/**
 * What a node would run `manifest`'s graphs on, as engine and service options take it
 * (`{ kernels: lib }`, loaded into this process), so that a benchmark of the bare engine times
 * what `shoal serve` runs; `{}` where none of shoal's kernels apply, or they are off here (said on
 * stderr).
 */
export async function nodeKernels (manifest: Pick<ShardManifest, 'quantization' | 'opSet' | 'decodeAttention' | 'shape'>): Promise<{ kernels?: string }> {
  if (kernelsApplying(manifest).length === 0) return {}
  const k = await prepareNativeKernels(CACHE)
  if ('lib' in k) return { kernels: k.lib }
  process.stderr.write(`shoal's kernels are off here (${k.off}): the engine runs onnxruntime's, as a node without them would\n`)
  return {}
}

/**
 * The kernels a model's engines run with `nodeKernels`' library (a whole model's, or each stage's of a chain), as capabilities name them
 * (what speculation's exactness check reads: SpeculationInit.targetKernels); none without it.
 */
export function nodeTargetKernels (manifest: Pick<ShardManifest, 'quantization' | 'opSet' | 'decodeAttention' | 'shape'>, lib: { kernels?: string }): string[] {
  if (lib.kernels === undefined) return []
  return kernelsApplying(manifest)
}

/** The environment that gives a child process the library (its onnxruntime sessions know DecodeAttention and MatMulQ4). */
export function nativeKernelsEnv (lib: string): Record<string, string> {
  return { LD_PRELOAD: lib }
}
