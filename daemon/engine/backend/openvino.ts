/**
 * openvino-node backend (CPU, GPU, NPU, AUTO). openvino-node is an optional dependency: it is
 * imported dynamically and its absence is a BackendUnavailableError, never a crash. Types come from
 * the package's own declarations (scripts/dev/openvino-types.mjs provides them where it is absent).
 *
 * OpenVINO's Core.readModel reads the same ONNX stage graphs (external weights by path). KV stays
 * explicit graph I/O: the JS API cannot reset or inspect a stateful graph's internal state.
 */
import { mkdir } from 'node:fs/promises'
import { availableParallelism } from 'node:os'
import type { CompiledModel, InferRequest, NodeAddon, OVAny, Tensor as OvTensor } from 'openvino-node'
import { BackendUnavailableError, EngineError } from '../errors.ts'
import { openvinoCacheDir, type Backend, type BackendSession, type HostTensor, type LoadOptions, type TensorMap } from './types.ts'

export const OPENVINO_DEVICES = ['CPU', 'GPU', 'NPU', 'AUTO']

/** Loads openvino-node, or throws BackendUnavailableError saying why. */
export async function loadOpenvinoAddon (): Promise<NodeAddon> {
  let mod: typeof import('openvino-node')
  try {
    mod = await import('openvino-node')
  } catch (err) {
    throw new BackendUnavailableError(`openvino-node is not installed or cannot load: ${(err as Error).message}`, { cause: err })
  }
  // CommonJS module: `addon` is a named export, and also a property of the default export.
  const addon = mod.addon ?? (mod as unknown as { default?: { addon?: NodeAddon } }).default?.addon
  if (addon === undefined) throw new BackendUnavailableError('openvino-node loaded but exports no addon')
  return addon
}

export async function createOpenvinoBackend (): Promise<Backend> {
  const ov = await loadOpenvinoAddon()
  const core = new ov.Core()
  return {
    name: 'openvino',
    devices: () => {
      // getAvailableDevices lists e.g. 'GPU.0'; AUTO is always there when anything is.
      const found = core.getAvailableDevices()
      return [...new Set([...found, ...(found.length > 0 ? ['AUTO'] : [])])]
    },
    async load (graphPath, options) {
      let compiled: CompiledModel
      try {
        const config = compileConfig(options)
        if (typeof config.CACHE_DIR === 'string') {
          await mkdir(config.CACHE_DIR, { recursive: true })
          // By path, not readModel + compileModel: on a cache hit OpenVINO then imports the compiled
          // blob without reading (or converting) the ONNX graph at all.
          compiled = await core.compileModel(graphPath, options.device, config)
        } else {
          compiled = await core.compileModel(await core.readModel(graphPath), options.device, config)
        }
      } catch (err) {
        throw new EngineError(`openvino could not load ${graphPath} on ${options.device}: ${(err as Error).message}`, { cause: err })
      }
      return wrap(ov, compiled)
    },
  }
}

/**
 * compileModel's properties for a load. With a cache directory, CACHE_DIR: OpenVINO stores each
 * compiled model there keyed by the model, device and these properties, and a later compile of
 * the same graph imports the blob instead of compiling (seconds to minutes on GPU/NPU).
 */
export function compileConfig (options: LoadOptions): Record<string, OVAny> {
  const config: Record<string, OVAny> = { PERFORMANCE_HINT: 'LATENCY' }
  if (options.cacheDir !== undefined) config.CACHE_DIR = openvinoCacheDir(options.cacheDir)
  if (options.device === 'CPU') {
    config.INFERENCE_NUM_THREADS = options.threads ?? availableParallelism()
    // CPUs with bf16/fp16 units would otherwise lower precision; token-exact output needs f32.
    config.INFERENCE_PRECISION_HINT = 'f32'
  }
  return config
}

function wrap (ov: NodeAddon, compiled: CompiledModel): BackendSession {
  // One infer request per session; callers serialise runs (one request cannot run twice at once).
  const request: InferRequest = compiled.createInferRequest()
  const inputNames = compiled.inputs.map(o => o.getAnyName())
  const outputNames = compiled.outputs.map(o => o.getAnyName())
  let closed = false
  return {
    inputNames,
    outputNames,
    async run (feeds, fetches) {
      if (closed) throw new EngineError('session is closed')
      const inputs: Record<string, OvTensor> = {}
      for (const [name, t] of Object.entries(feeds)) {
        inputs[name] = new ov.Tensor(t.type === 'float32' ? 'f32' : 'i64', t.dims, t.data)
      }
      let out: Record<string, OvTensor>
      try {
        out = await request.inferAsync(inputs)
      } catch (err) {
        throw new EngineError(`openvino run failed: ${(err as Error).message}`, { cause: err })
      }
      const result: TensorMap = {}
      for (const name of fetches ?? outputNames) {
        const t = out[name]
        if (t === undefined) throw new EngineError(`openvino returned no output ${name}`)
        result[name] = toHost(ov, name, t)
      }
      return result
    },
    async close () {
      closed = true // the addon frees native objects when they are collected
    },
  }
}

function toHost (ov: NodeAddon, name: string, t: OvTensor): HostTensor {
  const dims = t.getShape()
  const type = t.getElementType()
  // Output tensors can alias the request's buffers, which the next run overwrites: copy.
  if (type === ov.element.f32) return { type: 'float32', data: (t.data as Float32Array).slice(), dims }
  if (type === ov.element.i64) return { type: 'int64', data: (t.data as BigInt64Array).slice(), dims }
  throw new EngineError(`output ${name} has unsupported element type ${String(type)}`)
}
