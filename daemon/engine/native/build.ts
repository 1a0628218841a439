/**
 * Builds shoal's kernel library (ort-kernels.c, with its headers) with the machine's C compiler
 * (`cc`), for this CPU (-march=native), once: under a cache directory, in a directory named by the
 * hash of the sources, the flags and the CPU's identity (a cache shared by machines with other
 * CPUs must not hand one machine another's instructions). The benchmarks build their C the same
 * way (reproduction/lib/native-kernels.ts).
 */
import { execFile } from 'node:child_process'
import { createHash } from 'node:crypto'
import { existsSync } from 'node:fs'
import { mkdir, readFile, rename, rm } from 'node:fs/promises'
import { join } from 'node:path'
import { promisify } from 'node:util'

const run = promisify(execFile)

export const KERNELS_SOURCE = join(import.meta.dirname, 'ort-kernels.c')
/** The headers the library's source includes: part of its hash. */
export const KERNELS_HEADERS: readonly string[] = [join(import.meta.dirname, 'decode-attention.h'), join(import.meta.dirname, 'q4-matmul.h'), join(import.meta.dirname, 'greedy-head.h'), join(import.meta.dirname, 'f32-matmul.h')]
/** Optimised for this CPU, with no fast-math (the kernels' sums keep their written order). */
export const KERNELS_CFLAGS: readonly string[] = ['-O3', '-march=native', '-shared', '-fPIC']
export const KERNELS_LIBRARY = 'libshoal-kernels.so'
/** A compile takes ~2 s on 2 cores; a compiler that hangs must not hold up a daemon's start. */
const BUILD_TIMEOUT_MS = 120_000

/** Whether this machine has a C compiler as `cc`. */
export async function hasCompiler (): Promise<boolean> {
  try {
    await run('cc', ['--version'], { timeout: 10_000 })
    return true
  } catch {
    return false
  }
}

let identity: Promise<string> | undefined

/**
 * What -march=native compiles for: the CPU's model name and its flags (Linux's /proc/cpuinfo);
 * empty where there is no such file. Read once a process: every engine session's load asks
 * (f32KernelFits), and the CPU does not change under it.
 */
async function cpuIdentity (): Promise<string> {
  identity ??= readFile('/proc/cpuinfo', 'utf8').catch(() => '').then(info => {
    const line = (key: string): string => info.split('\n').find(l => l.startsWith(key))?.split(':')[1]?.trim() ?? ''
    return `${line('model name')}\n${line('flags')}`
  })
  return await identity
}

/**
 * Whether MatMulF32 (f32-matmul.h) should run this CPU's f32 products: AVX2 and FMA, where it was
 * measured faster than MLAS at a few rows and level with it at many — eight-column tiles on AVX2
 * (docs/engine-notes.md, wave 43), sixteen-column ones on AVX-512 (wave 46: 0.79–0.95× MLAS's time
 * at one to eight rows, 0.91–1.06× at a prompt's 64–512). Without FMA its path is scalar, so
 * onnxruntime's stay.
 */
export async function f32KernelFits (): Promise<boolean> {
  const flags = new Set(((await cpuIdentity()).split('\n')[1] ?? '').split(/\s+/))
  return flags.has('avx2') && flags.has('fma')
}

export interface BuildSpec {
  source: string
  /** The file built, in the hash-named directory. */
  name: string
  flags: readonly string[]
  /** Linked after the source (-l…). */
  libs: readonly string[]
  /** Files the source includes: part of the hash. */
  headers?: readonly string[]
}

/** `spec.source` built by `cc` (once per source, headers, flags and CPU) under `cacheDir`; its absolute path. */
export async function buildC (spec: BuildSpec, cacheDir: string): Promise<string> {
  const hasher = createHash('sha256')
  for (const file of [spec.source, ...spec.headers ?? []]) hasher.update(await readFile(file))
  const flags = spec.flags.join(' ')
  hasher.update(flags)
  if (flags.includes('-march=native')) hasher.update(await cpuIdentity())
  const dir = join(cacheDir, hasher.digest('hex').slice(0, 16))
  const out = join(dir, spec.name)
  if (existsSync(out)) return out
  await mkdir(dir, { recursive: true })
  // Built under a name of its own and renamed: a concurrent build never leaves a half-written file.
  const tmp = `${out}.tmp-${process.pid}-${Math.random().toString(36).slice(2, 8)}`
  try {
    await run('cc', [...spec.flags, '-o', tmp, spec.source, ...spec.libs], { timeout: BUILD_TIMEOUT_MS })
    await rename(tmp, out)
  } catch (err) {
    await rm(tmp, { force: true })
    throw new Error(`building ${spec.source} with \`cc\` failed: ${(err as Error).message.split('\n')[0] ?? ''}`, { cause: err })
  }
  return out
}

/** Builds the kernel library under `cacheDir` (once per source and CPU); its absolute path. */
export async function buildKernelLibrary (cacheDir: string): Promise<string> {
  return await buildC({ source: KERNELS_SOURCE, name: KERNELS_LIBRARY, flags: KERNELS_CFLAGS, libs: ['-ldl', '-lm', '-lpthread'], headers: KERNELS_HEADERS }, cacheDir)
}
