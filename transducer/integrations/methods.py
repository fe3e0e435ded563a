"""``InstanceMethod``: a function bound to one object and set on it as an attribute (an integration's ``apply``
replaces a model's ``forward`` this way), which, unlike ``types.MethodType``, pickles: ``torch.save(model)``
after ``apply`` loads, bound to the loaded model."""

import inspect
import types


class InstanceMethod:
    """``function`` bound to ``obj``: called as ``obj.name(*args)``, with the bound method's signature (which
    transformers' Trainer reads) and ``__func__`` / ``__self__`` as a bound method has them. A bound method
    pickles as ``getattr(obj, function.__name__)``, which a loaded object does not have; this pickles as the
    function (by its qualified name) and the object."""

    def __init__(self, function, obj):
        self.__func__, self.__self__ = function, obj
        self.__name__, self.__doc__ = function.__name__, function.__doc__

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self):
        return inspect.signature(types.MethodType(self.__func__, self.__self__))

    def __reduce__(self):
        return InstanceMethod, (self.__func__, self.__self__)
