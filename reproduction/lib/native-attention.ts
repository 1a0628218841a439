/**
 * The fused one-position attention kernel (reproduction/native/ort-fused-attention.c), built for
 * the processes that measure or test the 'native' decode-attention form: a shared library that a
 * process gets through LD_PRELOAD (nativeAttentionEnv), so that every onnxruntime session it makes
 * knows the DecodeAttention op. A benchmark instrument: `shoal serve` neither builds nor loads it.
 * Built with the machine's C compiler (`cc`), for this CPU (-march=native), once per source: the
 * library's directory is named by the source's hash.
 */
import { execFile } from 'node:child_process'
import { createHash } from 'node:crypto'
import { existsSync } from 'node:fs'
import { mkdir, readFile, rename, rm } from 'node:fs/promises'
import { join, resolve } from 'node:path'
import { promisify } from 'node:util'

const ROOT = resolve(import.meta.dirname, '..', '..')
export const NATIVE_ATTENTION_SOURCE = join(ROOT, 'reproduction', 'native', 'ort-fused-attention.c')
const LIBRARY = 'libshoal-fused-attention.so'

/** The compiler's flags: optimised for this CPU, with no fast-math (the kernel's sums keep their written order). */
export const NATIVE_ATTENTION_CFLAGS = ['-O3', '-march=native', '-shared', '-fPIC']

/** Whether this machine has a C compiler as `cc` (a test of the kernel is skipped without one). */
export async function hasCompiler (): Promise<boolean> {
  try {
    await promisify(execFile)('cc', ['--version'])
    return true
  } catch {
    return false
  }
}

/** Builds the kernel library (once per source) under `cacheDir`; its absolute path. */
export async function buildNativeAttention (cacheDir = join(ROOT, '.cache', 'native-attention')): Promise<string> {
  const source = await readFile(NATIVE_ATTENTION_SOURCE)
  const hash = createHash('sha256').update(source).update(NATIVE_ATTENTION_CFLAGS.join(' ')).digest('hex').slice(0, 16)
  const dir = join(cacheDir, hash)
  const lib = join(dir, LIBRARY)
  if (existsSync(lib)) return lib
  await mkdir(dir, { recursive: true })
  // Built under a name of its own and renamed: a concurrent build never leaves a half-written library.
  const tmp = `${lib}.tmp-${process.pid}`
  try {
    await promisify(execFile)('cc', [...NATIVE_ATTENTION_CFLAGS, '-o', tmp, NATIVE_ATTENTION_SOURCE, '-ldl', '-lm'])
    await rename(tmp, lib)
  } catch (err) {
    await rm(tmp, { force: true })
    throw new Error(`building the fused attention kernel needs a C compiler as \`cc\`: ${(err as Error).message}`)
  }
  return lib
}

/** The environment that gives a child process the kernel (its onnxruntime sessions know DecodeAttention). */
export function nativeAttentionEnv (lib: string): Record<string, string> {
  return { LD_PRELOAD: lib }
}
