/**
 * `shoal doctor`: what this machine can do for the mesh, and the fix for each problem.
 * Each check is independent and returns a finding; nothing here changes the machine.
 */
import { createServer } from 'node:net'
import { access, constants, mkdir, readdir, stat } from 'node:fs/promises'
import { createRequire } from 'node:module'
import { dirname, join } from 'node:path'
import pkg from '../../package.json' with { type: 'json' }
import { ExitError } from '../exit-error.ts'
import { cacheRoot } from '../paths.ts'

type Level = 'ok' | 'warn' | 'fail'
interface Finding { level: Level, check: string, detail: string, fix?: string }

/** The one minimum, package.json's engines.node (">=22.18"), as scripts/toolchain.mjs reads it. */
const MINIMUM = /^>=\s*(\d+)(?:\.(\d+))?/.exec(pkg.engines.node)!.slice(1).map(n => Number(n ?? 0)) as [number, number]

function nodeVersion (): Finding {
  const [major = 0, minor = 0] = process.versions.node.split('.').map(Number)
  const ok = major > MINIMUM[0] || (major === MINIMUM[0] && minor >= MINIMUM[1])
  return ok
    ? { level: 'ok', check: 'node', detail: `Node ${process.versions.node}` }
    : { level: 'fail', check: 'node', detail: `Node ${process.versions.node} is older than ${MINIMUM.join('.')}`, fix: 'install Node 24 LTS, or run shoal through scripts/shoal.mjs (bin/shoal, npm start), which fetches it into .toolchain/' }
}

/**
 * The execution providers that can actually load: onnxruntime-node lists CUDA and TensorRT on
 * Linux x64 whether or not its install step fetched their libraries, so a provider that is not
 * bundled counts only when its library (libonnxruntime_providers_<name>) is beside the binding.
 */
export function installedProviders (backends: Array<{ name: string, bundled: boolean }>, binFiles: string[]): string[] {
  return backends.filter(b => b.bundled || binFiles.some(f => f.includes(`onnxruntime_providers_${b.name}`))).map(b => b.name)
}

async function onnxruntime (): Promise<Finding> {
  try {
    const ort = await import('onnxruntime-node')
    const require = createRequire(import.meta.url)
    const version = (require('onnxruntime-node/package.json') as { version: string }).version
    const binDir = join(dirname(require.resolve('onnxruntime-node/package.json')), 'bin', 'napi-v6', process.platform, process.arch)
    const files = await readdir(binDir).catch(() => [] as string[])
    const backends = typeof ort.listSupportedBackends === 'function' ? installedProviders(ort.listSupportedBackends(), files).join(', ') : 'cpu'
    return { level: 'ok', check: 'onnxruntime', detail: `onnxruntime-node ${version} (${backends})` }
  } catch (err) {
    return { level: 'fail', check: 'onnxruntime', detail: `onnxruntime-node does not load: ${(err as Error).message}`, fix: 'reinstall dependencies: npm ci' }
  }
}

async function openvino (): Promise<Finding> {
  let ov: { addon?: { Core: new () => { getAvailableDevices(): string[] } } }
  try {
    ov = await import('openvino-node' as string) as typeof ov
  } catch {
    return { level: 'warn', check: 'openvino', detail: 'openvino-node is not installed: GPU/NPU unavailable, CPU inference uses onnxruntime', fix: 'on an AI PC with internet access: npm install openvino-node (its install step downloads the OpenVINO runtime)' }
  }
  try {
    const core = new ov.addon!.Core()
    return { level: 'ok', check: 'openvino', detail: `OpenVINO devices: ${core.getAvailableDevices().join(', ') || 'none'}` }
  } catch (err) {
    return { level: 'warn', check: 'openvino', detail: `openvino-node loads but its runtime failed: ${(err as Error).message}`, fix: 'reinstall openvino-node; check GPU/NPU drivers' }
  }
}

async function port (port: number): Promise<Finding> {
  const free = await new Promise<boolean>((resolve) => {
    const server = createServer()
    server.once('error', () => { resolve(false) })
    server.listen(port, '127.0.0.1', () => { server.close(() => { resolve(true) }) })
  })
  return free
    ? { level: 'ok', check: 'port', detail: `127.0.0.1:${port} is free for the API` }
    : { level: 'warn', check: 'port', detail: `127.0.0.1:${port} is in use`, fix: `pick another with --api 127.0.0.1:PORT (or --port for demo)` }
}

async function cache (): Promise<Finding> {
  const dir = cacheRoot()
  try {
    await mkdir(dir, { recursive: true })
    await access(dir, constants.W_OK)
    return { level: 'ok', check: 'cache', detail: `${dir} is writable` }
  } catch (err) {
    return { level: 'fail', check: 'cache', detail: `${dir} is not writable: ${(err as Error).message}`, fix: 'set SHOAL_CACHE to a writable directory' }
  }
}

/**
 * OpenVINO's compiled-model cache (CACHE_DIR, under the cache root): how many compiled graphs a
 * restart can load without recompiling (seconds to minutes per graph on GPU/NPU).
 */
export async function compiledCache (root: string): Promise<Finding> {
  const { compiledCacheDir, openvinoCacheDir } = await import('../../daemon/engine/index.ts')
  const dir = openvinoCacheDir(compiledCacheDir(root))
  let names: string[]
  try {
    names = await readdir(dir)
  } catch {
    return { level: 'ok', check: 'compiled', detail: `${dir}: empty (OpenVINO fills it on the first load of each graph per device)` }
  }
  try {
    await access(dir, constants.W_OK)
  } catch {
    return { level: 'warn', check: 'compiled', detail: `${dir} is not writable: OpenVINO recompiles every graph at every start`, fix: `make it writable, or set SHOAL_CACHE to a writable directory` }
  }
  let count = 0
  let bytes = 0
  for (const name of names) {
    if (!name.endsWith('.blob')) continue
    count++
    bytes += (await stat(join(dir, name)).catch(() => ({ size: 0 }))).size
  }
  return { level: 'ok', check: 'compiled', detail: `${dir}: ${count} compiled model${count === 1 ? '' : 's'} (${(bytes / 1048576).toFixed(1)} MiB), loaded at start without recompiling` }
}

/**
 * What this CPU's onnxruntime kernels decide (daemon/engine/kernel-probe.ts, ~1 s): whether int4
 * batching keeps every sequence's bits, and which one-position attention `shoal shard` here
 * takes — timed at a common head shape (8 query heads, 2 kv heads, head dim 64); `shoal shard`
 * times the model's own. A fleet of mixed CPUs that copies shards between machines serves them at
 * the compiling machine's choice: this line says what each machine would choose.
 */
export async function kernels (): Promise<Finding> {
  try {
    const { decodeAttentionForm, int4BatchingVerdict, matMulNBitsRowInvariance } = await import('../../daemon/engine/index.ts')
    const rows = await matMulNBitsRowInvariance(4, 32)
    const form = await decodeAttentionForm({ numHeads: 8, numKvHeads: 2, headDim: 64 })
    const int4 = `onnxruntime's int4 batching ${int4BatchingVerdict(rows)}${rows.rowInvariant ? '' : ` (max difference ${rows.maxDiff.toExponential(1)})`}`
    return { level: 'ok', check: 'kernels', detail: `${int4}; one-position attention: grouped takes ${form.ratio.toFixed(2)}× per-head's time here, so shoal shard here takes ${form.form}` }
  } catch (err) {
    return { level: 'warn', check: 'kernels', detail: `kernel probes failed: ${(err as Error).message}`, fix: 'check that the temporary directory is writable (the probes write small graphs there)' }
  }
}

/**
 * Whether shoal's own kernels build here and pass their self-check (daemon/engine/native: what
 * `shoal serve` and `shoal node` do at start, into the same cache), so that models run on them.
 */
export async function ownKernels (): Promise<Finding> {
  const { prepareNativeKernels } = await import('../../daemon/engine/index.ts')
  const k = await prepareNativeKernels(join(cacheRoot(), 'kernels'))
  if ('lib' in k) return { level: 'ok', check: 'own kernels', detail: `shoal's kernels build for this CPU and pass their self-check (${k.lib}): int4 products and one-position attention run on them, int4 batching bit-exact` }
  return { level: 'warn', check: 'own kernels', detail: `models run on onnxruntime's kernels alone, slower: shoal's are off here (${k.off})`, fix: 'on x86-64 Linux, install a C compiler as cc (Debian: apt install gcc); the next start builds them' }
}

async function identity (dir: string): Promise<Finding> {
  try {
    const certs = await import('../../certs/index.ts')
    const id = await certs.loadIdentity(dir)
    const verdict = certs.verifyNodeCertificate({ caCertificate: id.caCertificate, certificate: id.certificate, peerId: id.peerId })
    if (!verdict.admitted) {
      return { level: 'fail', check: 'identity', detail: `certificate refused: ${verdict.reason} (${verdict.detail})`, fix: 'issue a new one: shoal ca issue --dir CA --name NAME --out DIR' }
    }
    const days = (Date.parse(String(id.certificate.body.notAfter)) - Date.now()) / 86_400_000
    if (days < 14) return { level: 'warn', check: 'identity', detail: `${id.name} (${id.peerId}) expires in ${days.toFixed(1)} days`, fix: 'issue a fresh certificate before it expires' }
    return { level: 'ok', check: 'identity', detail: `${id.name} (${id.peerId}), valid for ${days.toFixed(0)} more days` }
  } catch (err) {
    return { level: 'fail', check: 'identity', detail: `${dir}: ${(err as Error).message}`, fix: 'point --identity at a directory made by shoal ca issue' }
  }
}

export async function runChecks (opts: { identity?: string }): Promise<Finding[]> {
  const findings = [nodeVersion(), await onnxruntime(), await openvino(), await port(8080), await cache(), await compiledCache(cacheRoot()), await kernels(), await ownKernels()]
  if (opts.identity !== undefined) findings.push(await identity(opts.identity))
  return findings
}

export async function doctor (opts: { identity?: string }): Promise<void> {
  const findings = await runChecks(opts)
  for (const f of findings) {
    process.stdout.write(`${f.level.padEnd(4)}  ${f.check.padEnd(11)}  ${f.detail}\n`)
    if (f.fix !== undefined) process.stdout.write(`${''.padEnd(19)}fix: ${f.fix}\n`)
  }
  if (findings.some(f => f.level === 'fail')) throw new ExitError('', 1)
}
