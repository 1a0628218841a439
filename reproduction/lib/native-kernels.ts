/**
 * The benchmark kernels (reproduction/native/ort-kernels.c: the fused one-position
 * attention, and the int4 products of q4-matmul.h), built for the processes that measure or test
 * the 'native' decode-attention form and the 'native' int4 kernel (and the bare C loop of the
 * attention, buildFusedLoop): a shared library that a process gets through LD_PRELOAD
 * (nativeKernelsEnv), so that every onnxruntime session it makes knows the DecodeAttention and
 * MatMulQ4 ops. A benchmark instrument: `shoal serve` neither builds nor loads it. Built with the
 * machine's C compiler (`cc`), for this CPU (-march=native), once per source: the library's
 * directory is named by the sources' hash.
 */
import { execFile } from 'node:child_process'
import { createHash } from 'node:crypto'
import { existsSync } from 'node:fs'
import { mkdir, readFile, rename, rm } from 'node:fs/promises'
import { join, resolve } from 'node:path'
import { promisify } from 'node:util'

const ROOT = resolve(import.meta.dirname, '..', '..')
const NATIVE = join(ROOT, 'reproduction', 'native')
export const NATIVE_KERNELS_SOURCE = join(NATIVE, 'ort-kernels.c')
/** The headers the library's source includes: part of its hash. */
const NATIVE_KERNELS_HEADERS = [join(NATIVE, 'q4-matmul.h')]

/** Which benchmark kernels a model's shards use: the attention, the int4 products, or both. */
export type NativeKernels = 'attention' | 'int4' | 'both'

/** The kernel's flags: optimised for this CPU, with no fast-math (the kernel's sums keep their written order). */
export const NATIVE_KERNELS_CFLAGS = ['-O3', '-march=native', '-shared', '-fPIC']

/** Whether this machine has a C compiler as `cc` (a test of the kernel is skipped without one). */
export async function hasCompiler (): Promise<boolean> {
  try {
    await promisify(execFile)('cc', ['--version'])
    return true
  } catch {
    return false
  }
}

/**
 * `source` built by `cc` with `flags` into `name` (then `libs` linked), once per source, the
 * `headers` it includes and flags: under `cacheDir`, in a directory named by their hash. Its
 * absolute path.
 */
async function buildC (source: string, name: string, flags: string[], libs: string[], cacheDir: string, headers: string[] = []): Promise<string> {
  const hasher = createHash('sha256')
  for (const file of [source, ...headers]) hasher.update(await readFile(file))
  const hash = hasher.update(flags.join(' ')).digest('hex').slice(0, 16)
  const dir = join(cacheDir, hash)
  const out = join(dir, name)
  if (existsSync(out)) return out
  await mkdir(dir, { recursive: true })
  // Built under a name of its own and renamed: a concurrent build never leaves a half-written file.
  const tmp = `${out}.tmp-${process.pid}`
  try {
    await promisify(execFile)('cc', [...flags, '-o', tmp, source, ...libs])
    await rename(tmp, out)
  } catch (err) {
    await rm(tmp, { force: true })
    throw new Error(`building ${source} needs a C compiler as \`cc\`: ${(err as Error).message}`)
  }
  return out
}

/** Builds the kernel library (once per source) under `cacheDir`; its absolute path. */
export async function buildNativeKernels (cacheDir = join(ROOT, '.cache', 'native-kernels')): Promise<string> {
  return await buildC(NATIVE_KERNELS_SOURCE, 'libshoal-kernels.so', NATIVE_KERNELS_CFLAGS, ['-ldl', '-lm', '-lpthread'], cacheDir, NATIVE_KERNELS_HEADERS)
}

/**
 * Builds the bare C loop of the same work (reproduction/native/fused-attention.c, a program timing
 * itself; bench-decode-attention.ts `--native`) with fast-math, as wave 33 timed it; its path.
 */
export async function buildFusedLoop (cacheDir = join(ROOT, '.cache', 'native-kernels')): Promise<string> {
  return await buildC(join(NATIVE, 'fused-attention.c'), 'fused-attention', ['-O3', '-march=native', '-ffast-math'], ['-lm'], cacheDir)
}

/** The environment that gives a child process the kernel (its onnxruntime sessions know DecodeAttention). */
export function nativeKernelsEnv (lib: string): Record<string, string> {
  return { LD_PRELOAD: lib }
}
