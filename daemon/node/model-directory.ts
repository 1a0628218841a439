/**
 * Several local services behind one InferenceService: dispatch by model id, list them all.
 */
import { ShoalError } from '../errors.ts'
import type { GenerateEvent, GenerateRequest, InferenceService, ModelCard } from '../service.ts'

export function createModelDirectory (services: InferenceService[]): InferenceService {
  const find = (model: string): InferenceService | undefined => services.find(s => s.models().some(m => m.id === model))
  return {
    models (): ModelCard[] {
      return services.flatMap(s => s.models())
    },
    async * generate (request: GenerateRequest, signal: AbortSignal): AsyncIterable<GenerateEvent> {
      const service = find(request.model)
      if (service === undefined) {
        const known = services.flatMap(s => s.models().map(m => m.id))
        throw new ShoalError('SHOAL_ERR_MODEL_NOT_FOUND', `model "${request.model}" does not exist here; models: ${known.join(', ') || 'none'}`)
      }
      yield * service.generate(request, signal)
    },
  }
}
